"""The methods: importing a method file registers it with :mod:`petl.core`.

Adding a method is one file here plus one import below; the API, the CLI, the contract tests and
the benchmark all read the registry.
"""

from petl.methods.adapter import apply_adapter
from petl.methods.adapter_plus import apply_adapter_plus
from petl.methods.convpass import apply_convpass
from petl.methods.full import apply_full
from petl.methods.hydra import apply_hydra
from petl.methods.linear import apply_linear
from petl.methods.lora import apply_lora
from petl.methods.mlp import apply_mlp
from petl.methods.partial import apply_partial
from petl.methods.peft_bridge import apply_peft
from petl.methods.sct import apply_sct
from petl.methods.vpt import apply_vpt

__all__ = [
    "apply_adapter",
    "apply_adapter_plus",
    "apply_convpass",
    "apply_full",
    "apply_hydra",
    "apply_linear",
    "apply_lora",
    "apply_mlp",
    "apply_partial",
    "apply_peft",
    "apply_sct",
    "apply_vpt",
]
