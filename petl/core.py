"""Method registry, the wrapper base class, and the helpers every method shares.

A method is a config dataclass (subclass of :class:`MethodConfig`) plus an ``inject`` function
registered with :func:`register_method`.  :func:`apply` does the parts every method shares
(check the model, freeze it, reset the head, record the config) so that a method file only adds
its own modules.  Wrappers subclass :class:`PetlModule` and keep the wrapped layer as ``base``;
merging, saving and counting find them by ``isinstance``, never by parameter-name substrings.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, ClassVar, NamedTuple

import torch
from torch import nn

from petl.model.backbone import backbone_of


@dataclass
class MethodConfig:
    """Options shared by every method.

    Attributes:
        num_classes: reset the classifier head to this many classes; ``None`` keeps the head.
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
        if self.num_classes is not None and (
            isinstance(self.num_classes, bool) or not isinstance(self.num_classes, numbers.Integral)
        ):
            # 2.5 or "3" would otherwise reach torch as a layer size and fail there with its own message.
            raise ValueError(f"num_classes={self.num_classes!r} is not a whole number: give an int, e.g. num_classes=3")
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float):
                check_range(f.name, value)
        if self.num_classes is not None:
            check_range("num_classes", self.num_classes, low=1)


def check_range(
    field: str,
    value: float,
    low: float | None = None,
    high: float | None = None,
    *,
    open_low: bool = False,
    open_high: bool = False,
) -> None:
    """Raise a ValueError naming ``field`` when ``value`` is NaN, infinite, or outside its bounds.

    The one range check of petl: method configs call it directly, the run config
    (:mod:`petl.train.config`) wraps it to raise its ConfigError.

    Args:
        field: the option's name as the user typed it (``rank``, ``train.lr``).
        value: the value to check; ``None`` (an unset optional option) passes.
        low: lower bound, ``None`` for none.
        high: upper bound, ``None`` for none.
        open_low: the lower bound itself is not allowed (``(0, inf]``).
        open_high: the upper bound itself is not allowed (``[0, 1)``).

    """
    if value is None:
        return
    bounds = (
        f"{'(' if open_low else '['}{'-inf' if low is None else low}, "
        f"{'inf' if high is None else high}{')' if open_high else ']'}"
    )
    # NaN compares False with everything, so it would pass every bound below; inf is never meant.
    if isinstance(value, float) and not math.isfinite(value):
        allowed = f": allowed {bounds}" if low is not None or high is not None else ""
        raise ValueError(f"{field}={value} is not a finite number{allowed}")
    below = low is not None and (value <= low if open_low else value < low)
    above = high is not None and (value >= high if open_high else value > high)
    if below or above:
        raise ValueError(f"{field}={value} is out of range: allowed {bounds}")


def check_dropout(field: str, value: float) -> None:
    """Raise a ValueError naming ``field`` unless ``value`` is a dropout probability in [0, 1)."""
    check_range(field, value, low=0, high=1, open_high=True)


def check_nonzero(field: str, value: float, switches_off: str) -> None:
    """Raise a ValueError when a multiplier ``field`` is 0: it would silently switch ``switches_off`` off."""
    if value == 0:
        raise ValueError(f"{field}=0 switches {switches_off} off: choose a non-zero {field}")


def check_choice(field: str, value: Any, choices: tuple[str, ...]) -> None:
    """Raise a ValueError naming ``field`` and the valid choices when ``value`` is not one of them."""
    if value not in choices:
        raise ValueError(f"{field}={value!r} is not valid: choose one of {', '.join(choices)}")


def first_line(text: object, default: str = "") -> str:
    """The first non-blank line of ``text`` (an error's message, say), stripped; ``default`` when there is none."""
    return next((line.strip() for line in str(text).splitlines() if line.strip()), default)


def to_str_tuple(value: Any) -> tuple[str, ...]:
    """Normalise a config's sequence-of-strings field to a tuple.

    The CLI hands over lists (or OmegaConf ListConfigs) where the dataclass declares a tuple, and a
    comma-separated string is the easiest way to type a list on a command line, so all three are
    accepted; the tuple keeps the config hashable and its JSON form stable.
    """
    if isinstance(value, str):
        return tuple(part.strip() for part in value.split(",") if part.strip())
    return tuple(str(part) for part in value)


def factory_kwargs(model: nn.Module) -> dict[str, Any]:
    """``device`` and ``dtype`` of ``model``'s first parameter, for building modules that live beside it."""
    first = next(model.parameters())
    return {"device": first.device, "dtype": first.dtype}


class PetlModule(nn.Module):
    """Base class of every petl wrapper: keeps the wrapped module as ``base``.

    A wrapper that can fold its update into ``base`` implements :meth:`fold` and :meth:`unfold` (as peft's
    ``BaseTunerLayer`` subclasses write only the merge itself); :meth:`merge` and :meth:`unmerge` keep the
    ``merged`` state, so folding twice or unfolding an unmerged wrapper cannot happen.
    """

    # Where the prompt tokens this wrapper adds to the token sequence sit: "front" (right after the class and
    # register tokens) or "end"; "" when it adds none.  timm's forward_intermediates strips them (petl.timm_api).
    prompt_place: ClassVar[str] = ""
    # Why this wrapper cannot run under timm's gradient checkpointing; "" when it can (petl.timm_api refuses
    # set_grad_checkpointing(True) with this reason).
    no_grad_checkpointing: ClassVar[str] = ""

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.base = base
        self._merged = False

    @property
    def merged(self) -> bool:
        """Whether the update is folded into ``base`` (forward then costs what ``base`` costs)."""
        return self._merged

    @property
    def mergeable(self) -> bool:
        """Whether this wrapper can merge: it implements :meth:`fold`."""
        return type(self).fold is not PetlModule.fold

    @torch.no_grad()
    def merge(self) -> None:
        """Fold this wrapper's update into ``base`` once (a merged wrapper stays as it is)."""
        if not self.mergeable:
            raise NotImplementedError(f"{type(self).__name__} cannot merge")
        if not self._merged:
            self.fold()
            self._merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        """Undo :meth:`merge` (an unmerged wrapper stays as it is)."""
        if not self.mergeable:
            raise NotImplementedError(f"{type(self).__name__} cannot unmerge")
        if self._merged:
            self.unfold()
            self._merged = False

    def merged_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The forward of a merged wrapper: ``base``'s alone, its update being in the weights."""
        # The wrapper's own module call stands in for base's: merged, this layer costs what the plain layer
        # costs (one module call and base's forward).  Hooks registered on ``base`` itself are skipped while
        # merged; hooks on this wrapper (the model's module at that path) still run.
        return self.base.forward(x)

    def fold(self) -> None:
        """Add the update into ``base``'s weights (mergeable wrappers implement it)."""
        raise NotImplementedError

    def unfold(self) -> None:
        """Take the update out of ``base``'s weights again (mergeable wrappers implement it)."""
        raise NotImplementedError


class PetlHead(nn.Module):
    """Base class of a classifier a method installs in place of timm's Linear head (Mlp-k's MLP, HST's head).

    timm's ``reset_classifier(n)`` would put a plain Linear in its place and silently drop the method; on a
    model from :func:`apply` it calls :meth:`for_classes` instead (:mod:`petl.timm_api`).
    """

    def for_classes(self, num_classes: int) -> nn.Module:
        """A fresh head of this method for ``num_classes`` (>= 1) classes, as :func:`apply` would build it."""
        raise NotImplementedError


# Foreign wrapper types (e.g. peft's tuner layers) that have merge()/unmerge() of their own.
_FOREIGN_MERGEABLE: list[type] = []


def register_mergeable_type(cls: type) -> None:
    """Let :func:`merge` / :func:`unmerge` also call ``merge()`` / ``unmerge()`` on instances of ``cls``."""
    if cls not in _FOREIGN_MERGEABLE:
        _FOREIGN_MERGEABLE.append(cls)


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


_REGISTRY: dict[str, MethodSpec] = {}


def register_method(
    name: str,
    config_cls: type[MethodConfig],
    trainable_formula: Callable[[nn.Module, MethodConfig], int],
    zero_init: bool = False,
    mergeable: bool = False,
    calibrate: Callable[..., MethodConfig] | None = None,
    backbones: tuple[str, ...] = ("vit",),
) -> Callable:
    """Decorator registering ``inject(model, cfg)`` as method ``name``.

    Args:
        name: the method name used by :func:`apply`, the CLI and the benchmark.
        config_cls: its config dataclass (the schema of its options).
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

    """

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
    if name not in _REGISTRY:
        raise ValueError(f"unknown method {name!r}; choose one of: {', '.join(list_methods())}")
    return _REGISTRY[name]


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


class ParamCount(NamedTuple):
    """Parameter counts of a model."""

    trainable: int
    trainable_no_head: int
    total: int


def count_params(model: nn.Module) -> ParamCount:
    """Count trainable parameters (with and without the classifier head) and all parameters."""
    head_ids = {id(p) for p in backbone_of(model).head().parameters()} if hasattr(model, "head") else set()
    trainable = [p for p in model.parameters() if p.requires_grad]
    return ParamCount(
        trainable=sum(p.numel() for p in trainable),
        trainable_no_head=sum(p.numel() for p in trainable if id(p) not in head_ids),
        total=sum(p.numel() for p in model.parameters()),
    )


def _mergeables(model: nn.Module) -> list[nn.Module]:
    found = [m for m in model.modules() if isinstance(m, PetlModule) and m.mergeable]
    found += [m for m in model.modules() if _FOREIGN_MERGEABLE and isinstance(m, tuple(_FOREIGN_MERGEABLE))]
    if not found:
        raise ValueError(f"nothing to merge: method {getattr(model, 'petl_method', None)!r} adds no mergeable layer")
    return found


@torch.no_grad()
def merge_updates(model: nn.Module) -> nn.Module:
    """Fold every mergeable wrapper's update into its frozen base weight (in place); see :func:`petl.merge`.

    All or nothing: a wrapper that refuses (a non-finite update, a layer without the bias a shift needs)
    raises after the wrappers merged before it are unmerged again, so the model is never half merged.
    """
    done: list[nn.Module] = []
    try:
        for module in _mergeables(model):
            if not getattr(module, "merged", False):
                module.merge()
                done.append(module)
    except Exception:
        for module in reversed(done):
            module.unmerge()
        raise
    return model


@torch.no_grad()
def unmerge(model: nn.Module) -> nn.Module:
    """Undo :func:`merge` (in place)."""
    for module in _mergeables(model):
        module.unmerge()
    return model


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The trained tensors by name (what :func:`save_trainable` writes).

    Besides the parameters that require grad, the buffers of modules whose own parameters all
    train: the running statistics of a trained BatchNorm (Mlp-k's head) are learnt state too.
    """
    state = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    for prefix, module in model.named_modules():
        own = list(module.parameters(recurse=False))
        if own and all(p.requires_grad for p in own):
            for name, buffer in module.named_buffers(recurse=False):
                state[f"{prefix}.{name}" if prefix else name] = buffer.detach()
    return state
