"""FacT: the weight updates of all blocks as one factorised tensor (Jie & Deng, AAAI 2023).

Follows PETL_Vision's FacT (OSU-MLB/PETL_Vision@245d262 model/fact.py:L7-118, applied in
model/attention.py:L55-56, L90-91 and model/mlp.py:L52-53, L64-65).  Every block's qkv, proj, fc1
and fc2 get an update ``scale * V @ core @ U`` where ``U`` (dim -> rank) and ``V`` (rank -> dim)
are shared by all blocks and ``V`` starts at zero, so the model is unchanged at init (``init=zero``;
PETL_Vision's ViT re-draws U, V and the tensor-train cores with timm's ``init_weights`` after building
them, so its FacT really starts random: ``init=reference``, see :mod:`petl.methods._init`):

- ``tt`` (tensor-train): each block has its own cores - rank x rank for each of q, k, v and proj,
  4rank x rank for fc1 and rank x 4rank for fc2 (fact.py:L15-34).
- ``tk`` (Tucker): one shared rank^3 core ``C`` and a rank x (12 * depth) matrix ``P`` whose 12
  columns per block mix ``C`` into that block's 12 rank x rank cores: q, k, v, proj, then four for
  fc1 and four for fc2 (fact.py:L36-52, L81-116).  petl stores each block's columns of ``P`` on
  that block's wrappers; the count and the function are the same.

The MLP's 4*dim side is cut into four dim-wide chunks, each with its own rank x rank core, in the
reference's layout (fact.py:L69-78, L97-116).  Dropout 0.1 acts on the rank-sized hidden
(fact.py:L27, L32, L49-50).  Defaults are PETL_Vision's (main.py:L132-138): rank 8, scale 1;
the type defaults to ``tk``, the variant behind V-PETL's "FacT" row.  The updates are linear in
the input, so ``merge`` adds them to the frozen weights.

In a parallel block (``vit_parallel``) qkv and fc1 are rows of one ``in_proj`` (fc1's first): each gets its own
wrapper on its rows, the fc1 one around the qkv one, with the cores and P columns of its kind, so the tensor is the
reference's.  FacT needs the MLP at 4 x the width: ``vit_pwee_*`` (5 x) is refused, ``vit_*_xp_*`` (4 x) is not.

The shared factors are registered once, on block 0's qkv wrapper; the other wrappers reach them
through an unregistered reference, so every parameter has exactly one name in the state dict.

Trains:
    FacT: qkv/proj/fc1/fc2 updates factorised across all blocks (shared U, V; Tucker core ``type=tk`` or
    per-block tensor-train cores ``type=tt``); mergeable.

Reference:
    - OSU-MLB/PETL_Vision@245d262 model/fact.py L7-118; model/attention.py L55-56, L90-91; model/mlp.py L52-53,
      L64-65; main.py L132-138

Differences:
    - ``init=zero`` (default) starts ``V`` at zero; PETL_Vision's ViT re-draws U, V and the tensor-train cores with
      timm's ``init_weights`` (model/vision_transformer.py L207-208), so its FacT really starts random:
      ``init=reference``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from petl.methods import _init, _reparam
from petl.model import rows, surgery
from petl.model.backbone import backbone_of, unwrap
from petl.model.registry import MethodConfig, register_method
from petl.model.wrappers import PetlModule, factory_kwargs
from petl.utils.checks import check_choice, check_dropout, check_nonzero, check_range

TYPES = ("tt", "tk")
# Per-block columns of the Tucker mixing matrix P, in the reference's order (fact.py:L84-116).
TK_COLUMNS = {"qkv": (0, 3), "proj": (3, 4), "fc1": (4, 8), "fc2": (8, 12)}
TK_PER_BLOCK = 12
LINEARS = tuple(TK_COLUMNS)


@dataclass
class FactConfig(_init.InitOption, MethodConfig):
    """Options of FacT.

    Attributes:
        type: ``tk`` (Tucker, one shared core) or ``tt`` (tensor-train, per-block cores).
        rank: the factorisation rank (PETL_Vision's ``fact_dim``).
        scale: factor on every update (``fact_scaler``).
        dropout: dropout on the rank-sized hidden (train mode only).
        init: ``zero`` (petl's default: the model is unchanged at init) or ``reference``: U, V and the
            tensor-train cores (nn.Linear weights in the reference) trunc_normal(std 0.02), as PETL_Vision's
            ViT leaves them (timm 0.9.12's ``init_weights``; the Tucker core and P keep their init; see
            :mod:`petl.methods._init`).

    """

    type: str = "tk"
    rank: int = 8
    scale: float = 1.0
    dropout: float = 0.1
    init: str = "zero"

    def validate(self, model: nn.Module) -> None:
        bb = backbone_of(model)
        super().validate(model)
        check_choice("type", self.type, TYPES)
        check_range("rank", self.rank, low=1)
        check_dropout("dropout", self.dropout)
        check_nonzero("scale", self.scale, "the factorised update")
        d = bb.width()
        for block in bb.block_list():
            _, start, end = bb.target_rows(block, "fc1")
            if end - start != 4 * d:
                raise ValueError(f"FacT needs an MLP of width 4 x embed dim ({4 * d}); this one has {end - start}")


class FactorsShared(nn.Module):
    """The factors every block shares: U (dim -> rank), V (rank -> dim, zero at init) and, for tk, C."""

    def __init__(self, dim: int, rank: int, tucker: bool, kw: dict[str, Any]) -> None:
        super().__init__()
        self.u = nn.Parameter(torch.empty(rank, dim, **kw))
        self.v = nn.Parameter(torch.zeros(dim, rank, **kw))
        nn.init.kaiming_uniform_(self.u, a=math.sqrt(5))  # nn.Linear's init, as the reference's FacTu
        self.c = None
        if tucker:
            self.c = nn.Parameter(torch.empty(rank, rank, rank, **kw))
            nn.init.xavier_uniform_(self.c)


class FactLinear(PetlModule):
    """A frozen Linear (qkv, proj, fc1 or fc2) plus its FacT update.

    Args:
        base: the Linear; kept frozen as ``base``.
        kind: which of ``qkv``, ``proj``, ``fc1``, ``fc2`` it is (sets the core layout).
        shared: the shared factors; registered here when ``owner`` is true, else only referenced.
        owner: whether this wrapper registers ``shared``.
        tucker: tk (cores mixed from ``shared.c`` by this block's columns of P) or tt (own cores).
        p_bound: half-width of the uniform init of P's columns (xavier over the whole P).
        scale: factor on the update.
        dropout: dropout on the rank-sized hidden.
        out_rows: the rows [start, end) of ``base``'s output that are ``kind`` (a parallel block's qkv or fc1 rows
            of ``in_proj``, ``base`` then possibly the other rows' FactLinear); ``None``: all of them.

    """

    def __init__(
        self,
        base: nn.Linear,
        kind: str,
        shared: FactorsShared,
        owner: bool,
        tucker: bool,
        p_bound: float,
        scale: float,
        dropout: float,
        out_rows: tuple[int, int] | None = None,
    ) -> None:
        super().__init__(base)
        self.kind, self.scale, self.out_rows = kind, scale, out_rows
        rank = shared.u.shape[0]
        kw = factory_kwargs(base)
        if owner:
            self.shared = shared
        else:
            # A list hides the module from registration: one name per parameter in the state dict.
            self._shared_ref = [shared]
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.train(base.training)  # new modules start in train mode; follow the model's mode instead
        self.p = self.cores = None
        if tucker:
            start, end = TK_COLUMNS[kind]
            self.p = nn.Parameter(torch.empty(rank, end - start, **kw))
            nn.init.uniform_(self.p, -p_bound, p_bound)
        else:
            shapes = {"qkv": (3, rank, rank), "proj": (1, rank, rank), "fc1": (1, 4 * rank, rank)}
            self.cores = nn.Parameter(torch.empty(shapes.get(kind, (1, rank, 4 * rank)), **kw))
            # Each tt core is an nn.Linear weight in the reference: the same init.
            for core_ in self.cores:
                nn.init.kaiming_uniform_(core_, a=math.sqrt(5))

    @property
    def factors(self) -> FactorsShared:
        """The shared U, V (and C)."""
        return self.shared if "shared" in self._modules else self._shared_ref[0]

    def block_cores(self) -> list[torch.Tensor]:
        """This layer's cores as (out x in) matrices: q, k, v for qkv; one for proj; fc1 4r x r; fc2 r x 4r."""
        if self.cores is not None:
            return list(self.cores.unbind(0))
        mixed = self.factors.c @ self.p  # (r, r, columns): C mixed by this block's columns of P
        r = mixed.shape[0]
        if self.kind == "fc1":
            # The reference flattens the four fc1 cores to r x 4r (in x out) and reads its output
            # as four chunks of r (fact.py:L100-105): as an (out x in) matrix, the transpose.
            return [mixed.reshape(r, -1).t()]
        if self.kind == "fc2":
            return [mixed.reshape(r, -1)]  # already (out x in): x_u (4r) @ this.t() (fact.py:L112-116)
        return [mixed[:, :, j].t() for j in range(mixed.shape[2])]  # x_u @ core (fact.py:L85-96)

    def update(self, x: torch.Tensor) -> torch.Tensor:
        """The FacT branch's output for input ``x`` (scale included)."""
        f = self.factors
        cores = self.block_cores()
        if self.kind == "fc2":
            # The 4*dim input as four dim-wide chunks, each projected by U, then one r x 4r core.
            xu = F.linear(x.unflatten(-1, (4, -1)), f.u).flatten(-2)
            return self.scale * F.linear(self.dropout(F.linear(xu, cores[0])), f.v)
        xu = F.linear(x, f.u)
        if self.kind == "fc1":
            h = self.dropout(F.linear(xu, cores[0])).unflatten(-1, (4, -1))
            return self.scale * F.linear(h, f.v).flatten(-2)
        return self.scale * torch.cat([F.linear(self.dropout(F.linear(xu, c)), f.v) for c in cores], dim=-1)

    def low_rank(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The update as two matrices, ``update(x) = x A^T B^T`` in eval (``delta_weight`` is ``B @ A``).

        A is U (fc2: this layer's core times U on each of the four input chunks), B the rest, the scale in it.
        """
        u, v = self.factors.u, self.factors.v
        cores = self.block_cores()
        if self.kind == "fc2":  # x's four chunks through U, then the r x 4r core: A = core @ blockdiag(U, U, U, U)
            return cores[0] @ torch.block_diag(u, u, u, u), self.scale * v
        if self.kind == "fc1":  # four dim-row chunks of the output, chunk j from core rows [j r, (j+1) r)
            return u, self.scale * torch.cat([v @ chunk for chunk in cores[0].chunk(4, dim=0)])
        return u, self.scale * torch.cat([v @ c for c in cores])

    def delta_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The update as a weight matrix of ``base``'s shape, in ``dtype``."""
        u, v = self.factors.u.to(dtype), self.factors.v.to(dtype)
        cores = [c.to(dtype) for c in self.block_cores()]
        if self.kind == "fc1":  # four dim-row chunks, chunk j from core rows [j r, (j+1) r)
            delta = torch.cat([v @ chunk @ u for chunk in cores[0].chunk(4, dim=0)], dim=0)
        elif self.kind == "fc2":  # four dim-column chunks, chunk j from core columns [j r, (j+1) r)
            delta = torch.cat([v @ chunk @ u for chunk in cores[0].chunk(4, dim=1)], dim=1)
        else:
            delta = torch.cat([v @ c @ u for c in cores], dim=0)
        return self.scale * delta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.merged:
            return self.merged_forward(x)
        return self.add_update(x, self.base(x))

    def add_update(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (the frozen output for ``x``) plus the update, on :attr:`out_rows` where set."""
        if self.out_rows is None:
            return y + self.update(x)
        start, end = self.out_rows
        return torch.cat([y[..., :start], y[..., start:end] + self.update(x), y[..., end:]], dim=-1)

    def _weight(self) -> torch.Tensor:
        """The frozen weight's rows the update adds to (a view: writes reach the Linear)."""
        weight = unwrap(self.base).weight
        return weight if self.out_rows is None else weight[self.out_rows[0] : self.out_rows[1]]

    @torch.no_grad()
    def fold(self) -> None:
        """Add the update into the frozen weight; forward then costs what ``base`` costs."""
        weight = self._weight()
        dtype = _reparam.work_dtype(weight)
        delta = self.delta_weight(dtype)
        _reparam.check_finite("the FacT update", delta)
        _reparam.write(weight, weight.to(dtype) + delta, "the FacT update into the weight")

    @torch.no_grad()
    def unfold(self) -> None:
        """Subtract the update again (up to rounding)."""
        weight = self._weight()
        dtype = _reparam.work_dtype(weight)
        _reparam.write(weight, weight.to(dtype) - self.delta_weight(dtype), "the FacT update out of the weight")


@rows.register_row_hook(FactLinear)
def _rows(wrapper: FactLinear) -> rows.RowHook:
    # The update reads the layer's input only: frozen output once for the batch, each task's update on its rows.
    # Served (eval, no dropout), it is x -> A -> B with the factors multiplied out once: two matmuls, not the
    # factor-by-factor chain, and it stacks with LoRA updates of the same rank.
    with torch.no_grad():
        a, b = wrapper.low_rank()
        if wrapper.out_rows is not None:  # B's rows at this kind's rows of the Linear's output, zeros elsewhere
            full = b.new_zeros(unwrap(wrapper).out_features, b.shape[1])
            full[wrapper.out_rows[0] : wrapper.out_rows[1]] = b
            b = full
    like = rows.per_device(a.t(), b.t())  # transposed once: tokens_linear and add_matmul_ take them so

    def add(x: torch.Tensor, y: torch.Tensor, _tokens: rows.Tokens) -> None:
        a_t, b_t = like(y)
        rows.add_matmul_(y, rows.tokens_linear(x, a_t), b_t)

    return rows.RowHook(wrapper.base, post_in_place=add, batched=rows.low_rank(a, b))


def _formula(model: nn.Module, cfg: FactConfig) -> int:
    bb = backbone_of(model)
    d, r, depth = bb.width(), cfg.rank, bb.depth()
    shared = 2 * d * r  # U and V
    if cfg.type == "tt":
        # Per block: q, k, v, proj cores r*r each, fc1 and fc2 cores 4r*r each = 12 r^2.
        return shared + depth * 12 * r * r
    # Tucker: the r^3 core plus 12 columns of P per block.
    return shared + r**3 + depth * TK_PER_BLOCK * r


# The backbones fact's idea fits: factors shared across every block's Linears, which needs one width for all blocks.
BACKBONES = ("vit", "naflexvit", "vit_relpos", "beit", "eva", "vit_parallel")
# Why not on the other backbone kinds (the refusal says it, and so does the docs page).
REFUSAL = (
    "FacT factorises every block's weights as one tensor whose factors U and V have the one embed width, "
    "and a Swin's width changes per stage"
)


@register_method(
    "fact",
    FactConfig,
    trainable_formula=_formula,
    zero_init=True,
    mergeable=True,
    backbones=BACKBONES,
    refusal=REFUSAL,
)
def inject_fact(model: nn.Module, cfg: FactConfig) -> None:
    """FacT: qkv/proj/fc1/fc2 updates factorised across all blocks (tensor-train or Tucker); mergeable."""
    bb = backbone_of(model)
    kw = factory_kwargs(model)
    tucker = cfg.type == "tk"
    shared = FactorsShared(bb.width(), cfg.rank, tucker, kw)
    # xavier-uniform over the whole rank x (12 * depth) P, as the reference initialises it.
    p_bound = math.sqrt(6.0 / (cfg.rank + TK_PER_BLOCK * bb.depth()))
    owner = True
    for block in bb.block_list():
        for kind in LINEARS:
            # The Linear of that name; in a parallel block qkv and fc1 are rows of in_proj (fc1's wraps qkv's).
            name, start, end = bb.target_rows(block, kind)
            linear = bb.linear(block, name)
            part = None if (start, end) == (0, unwrap(linear).out_features) else (start, end)
            wrapper = FactLinear(linear, kind, shared, owner, tucker, p_bound, cfg.scale, cfg.dropout, part)
            bb.set_linear(block, name, wrapper)
            owner = False
    if cfg.init == "reference":
        cores = [m.cores for m in model.modules() if isinstance(m, FactLinear) and m.cores is not None]
        _init.redraw(shared.u, shared.v, *cores)


def apply_fact(model: nn.Module, **options: Any) -> nn.Module:
    """Add FacT updates to every block of ``model`` and freeze everything else but the head.

    Args:
        model: a timm model of a backbone kind the method supports (its docs page; :func:`petl.list_backbones`).
        **options: fields of :class:`FactConfig` (``type``, ``rank``, ``scale``, ``dropout``,
            ``init``, ``num_classes``).

    Returns:
        The same model, modified in place.

    """
    return surgery.apply(model, "fact", **options)
