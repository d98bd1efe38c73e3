"""``init=zero|reference``: start a method as petl does, or as its reference's code really runs.

V-PETL Bench's model constructors call their own ``init_weights`` after building the method
(synbol/Parameter-Efficient-Transfer-Learning-Benchmark@c188fad ImageClassification/models/
vision_transformer_adapter.py L385, _lora.py L287, _adaptformer.py L407), and its ``init_weights_vit_timm``
(e.g. vision_transformer_lora.py L364-369) re-draws every ``nn.Linear`` with trunc_normal(std 0.02) and a zero
bias, the method's Linears included: the zero inits those files write just before (adapter L210-214, LoRA
L105-108, AdaptFormer L227-230) never reach training.  PETL_Vision does the same through timm's own
``init_weights`` (OSU-MLB/PETL_Vision@245d262 model/vision_transformer.py L207-208, under the timm 0.9.12 its
env_setup.sh pins): its adapter, Convpass and FacT Linears start random, not as model/utils.py's
``init_weight`` intends; convolutions and bare Parameters are left as they were.  NOAH's model does the same
(ZhangYuanhan-AI/NOAH@e9c55f3 model/supernet_vision_transformer_timm.py L462, ``_init_vit_weights`` L664-688):
its LoRA A and B and its adapters' projections start trunc_normal, its prompts (bare Parameters) xavier.

``zero`` (petl's default) keeps the zero-initialised half each method's paper describes, so the model is
unchanged at init and the update grows from the pretrained function; ``reference`` re-draws the same tensors
the references' ``init_weights`` re-draws, for reproduction presets.
"""

from __future__ import annotations

import torch
from torch import nn

from petl.utils.checks import check_choice

INITS = ("zero", "reference")
STD = 0.02  # init_weights_vit_timm's trunc_normal std


def check(value: str) -> None:
    """Raise a ValueError naming ``init`` unless ``value`` is one of :data:`INITS`."""
    check_choice("init", value, INITS)


class InitOption:
    """What a method config with an ``init: str = "zero"`` field shares: its validation and its contract.

    Listed before :class:`petl.model.registry.MethodConfig` among the config's bases.  The field itself stays in each
    config (``init: str = "zero"``, documented there), so it keeps its place among the config's options (the
    CLI, ``--help`` and the schema list them in field order); a plain class adds no dataclass field.
    """

    init: str

    @property
    def keeps_zero_init(self) -> bool:
        """``init=reference`` starts as the reference's code runs, not unchanged."""
        return self.init == "zero"

    def validate(self, model: nn.Module) -> None:
        """The base config's checks, then ``init``'s."""
        super().validate(model)
        check(self.init)


@torch.no_grad()
def redraw(*modules: nn.Module | nn.Parameter) -> None:
    """Re-draw as ``init_weights_vit_timm`` does: weights trunc_normal(std 0.02), biases zero.

    A bare tensor stands for the weight of a reference's nn.Linear.
    """
    for module in modules:
        if isinstance(module, nn.Linear):
            nn.init.trunc_normal_(module.weight, std=STD)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        else:
            nn.init.trunc_normal_(module, std=STD)
