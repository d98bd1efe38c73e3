"""The methods: importing a method file registers it with :mod:`petl.core`.

Adding a method is one file here plus one import below; the API, the CLI, the contract tests and
the benchmark all read the registry.
"""

from petl.methods.adapter import apply_adapter
from petl.methods.bitfit import apply_bitfit
from petl.methods.fact import apply_fact
from petl.methods.full import apply_full
from petl.methods.linear import apply_linear
from petl.methods.ln import apply_ln
from petl.methods.lora import apply_lora
from petl.methods.mlp import apply_mlp
from petl.methods.partial import apply_partial
from petl.methods.peft_bridge import apply_peft
from petl.methods.repadapter import apply_repadapter
from petl.methods.ssf import apply_ssf
from petl.methods.vpt import apply_vpt

__all__ = [
    "apply_adapter",
    "apply_bitfit",
    "apply_fact",
    "apply_full",
    "apply_linear",
    "apply_ln",
    "apply_lora",
    "apply_mlp",
    "apply_partial",
    "apply_peft",
    "apply_repadapter",
    "apply_ssf",
    "apply_vpt",
]
