"""The methods: importing a method file registers it with :mod:`petl.model.registry`.

Adding a method is one file here plus one import line below, written in the explicit re-export
form (``from petl.methods.x import apply_x as apply_x``): the API (``petl.apply``, and
``petl.apply_x`` through ``__all__``), the CLI's ``method`` group, the contract tests and the
benchmark all read the registry.
"""

from petl.methods import noah_search  # noqa: F401,E402  (registers NOAH's calibration: its subnet search)
from petl.methods.adapter import apply_adapter as apply_adapter
from petl.methods.adapter_plus import apply_adapter_plus as apply_adapter_plus
from petl.methods.bitfit import apply_bitfit as apply_bitfit
from petl.methods.convpass import apply_convpass as apply_convpass
from petl.methods.dtl import apply_dtl as apply_dtl
from petl.methods.fact import apply_fact as apply_fact
from petl.methods.full import apply_full as apply_full
from petl.methods.gps import apply_gps as apply_gps
from petl.methods.hst import apply_hst as apply_hst
from petl.methods.hydra import apply_hydra as apply_hydra
from petl.methods.last import apply_last as apply_last
from petl.methods.linear import apply_linear as apply_linear
from petl.methods.ln import apply_ln as apply_ln
from petl.methods.lora import apply_lora as apply_lora
from petl.methods.lst import apply_lst as apply_lst
from petl.methods.mlp import apply_mlp as apply_mlp
from petl.methods.noah import apply_noah as apply_noah
from petl.methods.partial import apply_partial as apply_partial
from petl.methods.peft_bridge import apply_peft as apply_peft
from petl.methods.repadapter import apply_repadapter as apply_repadapter
from petl.methods.sct import apply_sct as apply_sct
from petl.methods.snf import apply_snf as apply_snf
from petl.methods.ssf import apply_ssf as apply_ssf
from petl.methods.vpt import apply_vpt as apply_vpt

# Every apply_<name> imported above is public and re-exported by petl, so a new method's import
# line is all it takes (no list to keep in step here or in petl/__init__.py).
__all__ = sorted(name for name in dir() if name.startswith("apply_"))
