"""A bridge to Hugging Face peft: any tuner that ``peft.inject_adapter_in_model`` supports, on a timm ViT.

peft is imported only when this method is used, because importing it pulls in transformers and
would slow down ``import petl`` for everyone else.  The petl config keeps the peft config as
plain fields plus a JSON string of extra keyword arguments, so the CLI can build a schema from it
and ``save_trainable`` can record it.

Trains:
    any Hugging Face peft tuner that ``peft.inject_adapter_in_model`` supports (``peft_type``,
    ``target_modules``, ``options``: a JSON object of the peft config's other arguments; empty: peft's defaults, rank 8
    for LoRA).  Named presets: DoRA and IA3 (``petl.methods.peft_bridge.PRESETS``, experiment files ``dora`` and
    ``ia3``), counted in closed form.

Reference:
    - huggingface/peft ``inject_adapter_in_model`` (the tuner's own code is the reference)
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import json
import numbers
import re
import types
import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from petl.model import rows, surgery
from petl.model.backbone import backbone_of
from petl.model.merging import register_mergeable_type
from petl.model.registry import MethodConfig, fits_type, register_foreign_config, register_method, type_words
from petl.model.wrappers import MERGED_KEY, check_merged_not_training, holds_child
from petl.utils.checks import check_choice, to_str_tuple

if TYPE_CHECKING:
    from peft import PeftConfig

# Fields of a peft config that describe where it came from rather than what it does.
_PROVENANCE_FIELDS = ("peft_type", "target_modules", "peft_version", "base_model_name_or_path", "revision")
# LoRA options that leave the closed-form count r * (in + out) per adapted Linear intact.
_PLAIN_LORA_OPTIONS = {"r", "lora_alpha", "lora_dropout", "init_lora_weights", "use_rslora", "fan_in_fan_out"}


@dataclass
class PeftBridgeConfig(MethodConfig):
    """Options of the peft bridge.

    Attributes:
        peft_type: a peft tuner type that ``inject_adapter_in_model`` supports (``LORA``, ``IA3``, ``LOHA``...).
        target_modules: module-name suffixes to adapt, matched the way peft matches them (``qkv`` hits
            every ``blocks.N.attn.qkv``); one that matches no module (peft would pass over it) is refused, and so
            is none at all unless ``options`` gives peft's ``target_parameters``, and a ``layers_to_transform``
            index of ``options`` that matches none of their layers (the refusal names the indices peft reads).
            peft reads a layer's index after ``layers_pattern`` in the module's name: ``"blocks"`` on a ViT; on a
            Swin ``"blocks"`` (or none) gives a block's index within its stage, so ``[1]`` adapts the second block
            of every stage, and ``"layers"`` (``"stages"`` on a SwinV2Cr) a stage's index.
        options: JSON object of extra keyword arguments for the peft config, e.g. ``'{"r": 8, "lora_alpha": 8}'``;
            each value is checked against the peft config's annotation (``{"r": "x"}`` is refused naming ``r``).
            A ``target_modules`` key there (a regex string, say) replaces the field, which must then be empty
            (``target_modules=[]``), so that the recorded config says what was adapted: given both, the config is
            refused.  ``inference_mode`` is refused: petl trains what peft injects, and peft's inference mode
            freezes it.

    """

    peft_type: str = "LORA"
    target_modules: tuple[str, ...] = ("qkv",)
    options: str = "{}"

    def __post_init__(self) -> None:
        self.target_modules = to_str_tuple(self.target_modules, "target_modules")
        self.peft_type = str(self.peft_type).upper()

    def extra_options(self) -> dict[str, Any]:
        """``options`` parsed; a ValueError names the field when it is not a JSON object."""
        try:
            extra = json.loads(self.options)
        except json.JSONDecodeError as err:
            raise ValueError(f"options={self.options!r} is not valid JSON: {err}") from err
        if not isinstance(extra, dict):
            raise ValueError(f"options={self.options!r} must be a JSON object of peft config keyword arguments")
        return extra

    def to_peft(self) -> PeftConfig:
        """Build the peft config object these options describe."""
        from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING, PEFT_TYPE_TO_TUNER_MAPPING
        from peft.utils import PeftType

        # Only tuners that peft can inject into an arbitrary nn.Module in place qualify.
        supported = tuple(sorted(str(t.value) for t in PEFT_TYPE_TO_TUNER_MAPPING))
        check_choice("peft_type", self.peft_type, supported)
        extra = self.extra_options()
        if "inference_mode" in extra:
            # peft's inference mode injects its modules frozen, so petl would train the head alone.
            raise ValueError(f"options={self.options!r} sets inference_mode: petl trains what peft injects; drop it")
        if "target_modules" in extra and self.target_modules:
            raise ValueError(
                f"target_modules is given twice, as {list(self.target_modules)} and in options={self.options!r}: "
                "give it once (to use the options' value, set target_modules=[])"
            )
        config_cls = PEFT_TYPE_TO_CONFIG_MAPPING[PeftType(self.peft_type)]
        hints = typing.get_type_hints(config_cls)
        for key, value in extra.items():
            if key in hints and not _fits_peft(value, hints[key]):
                words = type_words(hints[key])
                raise ValueError(
                    f"options: {key}={value!r} is not {words} for peft's {config_cls.__name__}: give {words}"
                )
        kwargs: dict[str, Any] = {"target_modules": list(self.target_modules) or None, **extra}
        try:
            return config_cls(**kwargs)
        except (TypeError, ValueError) as err:
            raise ValueError(f"peft rejected options={self.options!r} for peft_type={self.peft_type}: {err}") from err

    def validate(self, model: nn.Module) -> None:
        super().validate(model)
        peft_config = self.to_peft()
        targets = peft_config.target_modules
        if targets is None:
            if getattr(peft_config, "target_parameters", None):  # peft adapts those parameters alone: taken
                return
            # peft would fail mid-injection on None, naming nothing.
            raise ValueError(
                "target_modules is empty and options names none: give the modules to adapt, e.g. target_modules=[qkv]"
            )
        # Caught here rather than by peft mid-injection, when the model would already be frozen; and each entry of a
        # list on its own, since peft passes over one that matches nothing (with layers_to_transform and
        # exclude_modules applied, as peft applies them).
        names = [name for name, _ in model.named_modules()]
        entries = [targets] if isinstance(targets, str) else sorted(targets)
        # Each entry without layers_to_transform, which is checked on its own below: an index that matches no layer
        # said "target_modules=['qkv'] match no module" beside a list of the blocks' Linears that named qkv.
        unmatched = [
            entry
            for entry in entries
            if not _matches_any(
                peft_config,
                names,
                target_modules=entry if isinstance(targets, str) else {entry},
                layers_to_transform=None,
            )
        ]
        if unmatched:
            block = backbone_of(model).block_list()[0]
            linears = [name for name, m in block.named_modules() if isinstance(m, nn.Linear)]
            # Some matching: peft would adapt what the others match and pass over these.
            which = f"target_modules={entries}" if len(unmatched) == len(entries) else f"{unmatched} of target_modules"
            raise ValueError(f"{which} match no module of this model; its blocks' Linears are {', '.join(linears)}")
        layers = getattr(peft_config, "layers_to_transform", None)
        layers = [layers] if isinstance(layers, int) else layers or []
        unmatched = [index for index in layers if not _matches_any(peft_config, names, layers_to_transform=[index])]
        if unmatched:  # an index past the depth, say: peft adapts the other layers and passes over these
            raise ValueError(
                f"options: layers_to_transform {unmatched} match no layer of target_modules={entries} on this model "
                f"({backbone_of(model).depth()} blocks): {_layer_indices(model, peft_config, names)}"
            )
        # What else peft refuses (r=0, a dropout of 2) it refuses as it builds its layers, when the model would
        # already be frozen and its head reset: built first on a meta-device copy, which allocates nothing.
        from peft import inject_adapter_in_model

        try:
            inject_adapter_in_model(on_meta(peft_config), surgery.meta_copy(model))
        except (TypeError, ValueError) as err:
            raise ValueError(f"peft rejected options={self.options!r} for peft_type={self.peft_type}: {err}") from None


def on_meta(peft_config: PeftConfig) -> PeftConfig:
    """``peft_config`` as a model on the meta device can take it: an initialisation computed from the frozen weights
    (``init_lora_weights='pissa'``, ``'olora'``: an SVD or QR of each weight, which peft then writes back into it)
    has no values to read there, so peft's default initialisation stands in; the layers' shapes are the same.
    """
    if isinstance(getattr(peft_config, "init_lora_weights", True), bool):
        return peft_config
    return dataclasses.replace(peft_config, init_lora_weights=True)


def _layer_indices(model: nn.Module, peft_config: PeftConfig, names: list[str]) -> str:
    """What to do about a ``layers_to_transform`` that matches no layer: the indices peft reads in this model's names.

    peft reads a layer's index after ``layers_pattern`` in a module's name, or without one after the first named
    segment that follows a dot: a ViT's ``blocks.N`` opens its names, so peft finds no index there, and a Swin's
    ``layers.S.blocks.N`` gives N, the block's index within its stage, not petl's block index across the stages.
    """
    found = [i for i in range(backbone_of(model).depth()) if _matches_any(peft_config, names, layers_to_transform=[i])]
    pattern = getattr(peft_config, "layers_pattern", None)
    if not found:
        return 'peft reads no layer index in their names: give options {"layers_pattern": "blocks"}'
    said = f"layers_pattern {pattern!r}" if pattern else "the first numbered name after a dot"
    return f"peft reads the layer indices {', '.join(map(str, found))} here (by {said}): give some of those"


def _matches_any(peft_config: PeftConfig, names: list[str], **fields: Any) -> bool:
    """Whether peft's own matcher adapts one of the modules ``names`` under ``peft_config`` with ``fields`` changed."""
    from peft.tuners.tuners_utils import check_target_module_exists

    alone = copy.copy(peft_config)
    for key, value in fields.items():
        setattr(alone, key, value)
    return any(check_target_module_exists(alone, name) for name in names)


def _fits_peft(value: Any, hint: Any) -> bool:
    """Whether an ``options`` value fits its peft annotation, as far as petl can tell.

    Looser than petl's own fields: peft annotates ``lora_alpha`` and ``alpha`` as int yet divides them as
    numbers (0.5 works), so any number but a bool passes an int; peft's nested config classes take dicts and
    are left to peft.
    """
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_fits_peft(value, arg) for arg in typing.get_args(hint))
    if hint is int:
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    if hint in (bool, float, str, dict, list, type(None)) or origin in (list, tuple, dict, typing.Literal):
        return fits_type(value, hint)
    return True


def _jsonable(name: str, value: Any) -> Any:
    """``value`` in a form json.dumps accepts (sets sorted into lists, enums by value)."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if isinstance(value, dict):
        return {k: _jsonable(f"{name}.{k}", v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(name, v) for v in value]
    try:
        json.dumps(value)
    except TypeError as err:
        raise ValueError(f"peft config field {name}={value!r} cannot be stored as JSON") from err
    return value


def config_from_peft(peft_config: PeftConfig, num_classes: int | None = None) -> PeftBridgeConfig:
    """Describe a ready peft config object as a :class:`PeftBridgeConfig`.

    Only fields that differ from the peft class's defaults go into ``options``, which keeps the
    recorded config short and readable.

    Args:
        peft_config: e.g. ``peft.LoraConfig(r=4, target_modules=["qkv"])``.
        num_classes: reset the classifier to this many classes; ``None`` keeps it.

    """
    extra: dict[str, Any] = {}
    for field in dataclasses.fields(peft_config):
        if field.name in _PROVENANCE_FIELDS or not field.init:
            continue
        value = getattr(peft_config, field.name)
        if field.default is not dataclasses.MISSING:
            default = field.default
        elif field.default_factory is not dataclasses.MISSING:
            default = field.default_factory()
        else:
            default = dataclasses.MISSING
        if default is dataclasses.MISSING or value != default:
            extra[field.name] = _jsonable(field.name, value)
    targets = peft_config.target_modules
    if isinstance(targets, str):
        # A regex string means "full match", a list means "suffix match"; keep the regex as it was.
        extra["target_modules"], targets = targets, ()
    return PeftBridgeConfig(
        num_classes=num_classes,
        peft_type=str(_jsonable("peft_type", peft_config.peft_type)),
        target_modules=tuple(sorted(targets or ())),
        options=json.dumps(extra, sort_keys=True),
    )


def _count_by_injecting(model: nn.Module, cfg: PeftBridgeConfig) -> int:
    # Tuners and options without a closed form below have shapes peft alone knows; count them on a
    # throwaway copy.  (This agrees with the injected model by construction, so the contract test
    # cannot catch a wrong count for them: add a closed form when a tuner becomes a preset.)
    from peft import inject_adapter_in_model

    trial = copy.deepcopy(model)
    trial.requires_grad_(False)
    inject_adapter_in_model(cfg.to_peft(), trial)
    head_ids = {id(p) for p in backbone_of(trial).head().parameters()}
    return sum(p.numel() for p in trial.parameters() if p.requires_grad and id(p) not in head_ids)


def _targets(model: nn.Module, peft_config: PeftConfig) -> list[tuple[str, nn.Module]]:
    """The modules outside the head that peft's own matcher says ``target_modules`` names."""
    from peft.tuners.tuners_utils import check_target_module_exists

    head_ids = {id(m) for m in backbone_of(model).head().modules()}
    return [
        (name, module)
        for name, module in model.named_modules()
        if id(module) not in head_ids and check_target_module_exists(peft_config, name)
    ]


def _target_linears(model: nn.Module, peft_config: PeftConfig) -> list[tuple[str, nn.Linear]]:
    """The Linears among :func:`_targets` (the closed forms count only those)."""
    return [(name, m) for name, m in _targets(model, peft_config) if isinstance(m, nn.Linear)]


def _is_feedforward(peft_config: PeftConfig, name: str) -> bool:
    # The rule of peft 0.21 tuners/ia3/model.py IA3Model._check_target_module_feedforward: a regex
    # string must match the whole module name, a list entry its end.
    modules = peft_config.feedforward_modules or ()
    if isinstance(modules, str):
        return re.fullmatch(modules, name) is not None
    return any(name.endswith(key) for key in modules)


def _lora_count(model: nn.Module, peft_config: PeftConfig) -> int:
    # A: r x in, B: out x r; DoRA adds one magnitude per output row (peft lora/dora.py, DoraLinearLayer).
    magnitude = 1 if peft_config.use_dora else 0
    return sum(
        peft_config.r * (m.in_features + m.out_features) + magnitude * m.out_features
        for _, m in _target_linears(model, peft_config)
    )


def _ia3_count(model: nn.Module, peft_config: PeftConfig) -> int:
    # One scale per input feature of a feedforward module, else per output feature (peft ia3/layer.py, Linear).
    return sum(
        m.in_features if _is_feedforward(peft_config, name) else m.out_features
        for name, m in _target_linears(model, peft_config)
    )


# peft type -> (closed-form counter, the options it accounts for: the others may add tensors).
_CLOSED_FORMS = {
    "LORA": (_lora_count, _PLAIN_LORA_OPTIONS | {"use_dora"}),
    "IA3": (_ia3_count, {"feedforward_modules", "init_ia3_weights", "fan_in_fan_out"}),
}


def _formula(model: nn.Module, cfg: PeftBridgeConfig) -> int:
    peft_config = cfg.to_peft()
    counter, options = _CLOSED_FORMS.get(cfg.peft_type, (None, set()))
    if counter is None or not set(cfg.extra_options()) - {"target_modules"} <= options:
        return _count_by_injecting(model, cfg)
    # A target that also names a non-Linear (`proj` matches patch_embed.proj, a Conv2d, as well as each block's
    # attn.proj): peft adapts it with shapes of its own, which the Linear closed forms do not count.
    if any(not isinstance(m, nn.Linear) for _, m in _targets(model, peft_config)):
        return _count_by_injecting(model, cfg)
    return counter(model, peft_config)


# Named presets: keyword options for ``petl.apply(model, "peft", **PRESETS[name])`` (docs/methods.md, "peft presets").
PRESETS: dict[str, dict[str, Any]] = {
    # DoRA (Liu et al., 2024): LoRA's low-rank direction plus a trained per-row magnitude, rank 8.  peft
    # adapts whole Linears, so this is one rank-8 update of the fused qkv (q, k and v together), not petl's
    # LoRA default of separate updates of the q and v slices: about as many weights, not the same placement.
    "dora": {"peft_type": "LORA", "target_modules": ("qkv",), "options": '{"r": 8, "lora_alpha": 8, "use_dora": true}'},
    # IA3 (Liu et al., 2022): learned rescaling of attention outputs and of the MLP's hidden
    # activations.  timm fuses q, k and v, so the qkv scale covers q too (the paper scales k and v).
    "ia3": {"peft_type": "IA3", "target_modules": ("qkv", "fc2"), "options": '{"feedforward_modules": ["fc2"]}'},
}


# The backbones peft's idea fits: peft's tuners on the Linears the backbone names.
BACKBONES = ("vit", "naflexvit", "swin", "swinv2", "swinv2_cr", "vit_relpos", "beit", "eva", "vit_parallel")


@register_method(
    "peft", PeftBridgeConfig, trainable_formula=_formula, zero_init=True, mergeable=True, backbones=BACKBONES
)
def inject_peft(model: nn.Module, cfg: PeftBridgeConfig) -> None:
    """Hugging Face peft tuners (LoRA by default) injected in place with peft.inject_adapter_in_model."""
    from peft import inject_adapter_in_model
    from peft.tuners.tuners_utils import BaseTunerLayer

    # peft's layers carry merge()/unmerge() of their own; let petl.merge reach them.
    register_mergeable_type(BaseTunerLayer)
    _register_row_hooks()
    peft_config = cfg.to_peft()
    if next(model.parameters()).is_meta:  # petl.apply's trial under gradient checkpointing
        peft_config = on_meta(peft_config)
    inject_adapter_in_model(peft_config, model)
    backbone_of(model).adopt_wrapped_linears()
    # What petl.merge promises of its wrappers, for peft's layers too: a state dict saying which are merged, and
    # no training forward of a merged one (peft's runs its base layer alone, leaving its tensors without gradient).
    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            module.register_state_dict_post_hook(_record_merged)
            module.register_load_state_dict_pre_hook(_restore_merged)
            module.register_forward_pre_hook(_refuse_merged_training)


def _record_merged(layer: Any, _state_dict: dict, _prefix: str, local_metadata: dict) -> None:
    """``state_dict``'s post-hook of a peft layer: record in its metadata which of its adapters are merged."""
    local_metadata[MERGED_KEY] = list(layer.merged_adapters)


def _restore_merged(layer: Any, state_dict: dict, prefix: str, local_metadata: dict, *_args: Any) -> None:
    """``load_state_dict``'s pre-hook of a peft layer: its base layer's weights (loaded with it) hold the merged
    adapters' updates as the saved layer's did, so it is marked merged as that one was (never counting one twice).
    A state dict without them (cut down to the adapters' tensors) leaves the layer's mark as it is.
    """
    if MERGED_KEY in local_metadata and holds_child(state_dict, prefix, "base_layer", layer.base_layer):
        layer.merged_adapters = list(local_metadata[MERGED_KEY])


def _refuse_merged_training(layer: Any, _args: tuple) -> None:
    """Forward pre-hook of a peft layer: a merged one refuses a forward that would train it (see
    :meth:`petl.PetlModule.check_not_training`).
    """
    if layer.merged:
        check_merged_not_training(layer, layer.get_base_layer())


def _register_row_hooks() -> None:
    """Let :class:`petl.MultiTask` serve peft's LoRA (DoRA included) and IA3 Linears in a mixed batch.

    Registered here rather than at import, because importing peft is slow; these run the part of peft's own
    ``forward`` that follows its base layer (peft 0.21 tuners/lora/layer.py ``Linear.forward``,
    tuners/ia3/layer.py ``Linear.forward``) on the rows' share of the frozen output computed once for the batch.
    Other peft tuners are refused by MultiTask with a line naming their layer.
    """
    from peft.tuners.ia3.layer import Linear as Ia3Linear
    from peft.tuners.lora.layer import Linear as PeftLoraLinear
    from peft.tuners.lora.variants import DoraLinearVariant

    @rows.register_row_hook(PeftLoraLinear)
    def _lora_rows(layer: PeftLoraLinear) -> rows.RowHook:
        adapters = [name for name in layer.active_adapters if name in layer.lora_A]
        for name in adapters:
            variant = layer.lora_variant.get(name)
            if variant is not None and not isinstance(variant, DoraLinearVariant):
                raise rows.CannotShare(f"peft's {type(variant).__name__} has no multi-task hook yet")

        def post(x: Any, y: Any, _tokens: rows.Tokens) -> Any:
            dtype = y.dtype
            for name in adapters:
                x = layer._cast_input_dtype(x, layer.lora_A[name].weight.dtype)
                if name in layer.lora_variant:  # DoRA: the magnitude rescales the frozen output it is given
                    y = layer.lora_variant[name].forward(layer, active_adapter=name, x=x, result=y)
                else:
                    y = y + layer.lora_B[name](layer.lora_A[name](layer.lora_dropout[name](x))) * layer.scaling[name]
            return y.to(dtype)

        return rows.RowHook(layer.get_base_layer(), post=post)

    @rows.register_row_hook(Ia3Linear)
    def _ia3_rows(layer: Ia3Linear) -> rows.RowHook:
        def scaling() -> Any:
            scale = 1
            for name in layer.active_adapters:
                if name in layer.ia3_l:
                    scale = scale * layer.ia3_l[name].flatten()
            return scale

        if layer.is_feedforward:  # scales the frozen Linear's input: each task's rows before the shared matmul
            return rows.RowHook(layer.get_base_layer(), pre=lambda x, _tokens: (x * scaling()).to(x.dtype))
        return rows.RowHook(layer.get_base_layer(), post=lambda x, y, _tokens: (y * scaling()).to(y.dtype))


def _is_peft_config(obj: Any) -> bool:
    # Recognised by class name and module, so `import petl` need not import peft (slow: it pulls in transformers).
    return any(c.__name__ == "PeftConfig" and c.__module__.split(".")[0] == "peft" for c in type(obj).__mro__)


# petl.apply(model, peft.LoraConfig(...)) goes through this bridge.
register_foreign_config(_is_peft_config, config_from_peft)


def apply_peft(model: nn.Module, peft_config: PeftConfig | None = None, **options: Any) -> nn.Module:
    """Inject a peft tuner into ``model`` in place; the head trains too.

    Args:
        model: a timm model of a backbone kind the method supports (its docs page; :func:`petl.list_backbones`).
        peft_config: a ready peft config object (e.g. ``peft.LoraConfig(...)``); its fields are
            recorded in the petl config so that ``save_trainable`` / ``load_trainable`` work.
        **options: fields of :class:`PeftBridgeConfig` (``peft_type``, ``target_modules``,
            ``options``, ``num_classes``); only ``num_classes`` may accompany ``peft_config``.

    Returns:
        The same model, modified in place.

    """
    if peft_config is None:
        return surgery.apply(model, "peft", **options)
    return surgery.apply(model, peft_config, **options)
