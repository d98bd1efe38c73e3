"""LoRA: low-rank updates ``scale * B @ A`` added to frozen Linear layers of every block.

Targets are ``q``, ``k``, ``v`` (row slices of timm's fused ``attn.qkv`` Linear, so adapting Q
and V leaves the K rows untouched; on EVA-02 with separate projections, ``q_proj``, ``k_proj``, ``v_proj``:
``Backbone.qkv_rows``), ``proj``, ``fc1`` and ``fc2``.  In a parallel block (``vit_parallel``) ``fc1``, ``q``,
``k`` and ``v`` are row slices of the one ``in_proj`` (one wrapper holds all of that Linear's updates), ``proj``
is ``attn_out_proj`` and ``fc2`` is ``mlp_out_proj`` (``Backbone.target_rows``).  B starts at zero, so the
model is unchanged at init, while A starts random, so B receives a gradient on the first step
(zeroing both would leave the branch without any gradient forever).  V-PETL Bench's LoRA
(vision_transformer_lora.py L100-108) is re-drawn by its constructor's ``init_weights`` (L287,
trunc_normal std 0.02 for every nn.Linear, L364-369), so there A and B both start random:
``init=reference`` starts that way (see :mod:`petl.methods._init`).

Trains:
    low-rank updates on the q/k/v slices of timm's fused ``qkv`` (Q and V by default), ``proj``, ``fc1``
    and/or ``fc2``; mergeable.

Reference:
    - synbol/Parameter-Efficient-Transfer-Learning-Benchmark@c188fad
      ImageClassification/models/vision_transformer_lora.py L100-108, L110-135, L158, L287, L364-369;
      ImageClassification/scripts/run_vit_lora.sh L4

Differences:
    - ``init=zero`` (default) starts B at zero, so the model is unchanged at init; V-PETL's constructor re-draws A
      and B trunc_normal(0.02) (``init_weights``, L287), so there both start random: ``init=reference``, which the
      V-PETL presets use.
    - petl scales the update by ``alpha / rank``; V-PETL adds ``B A x`` to the Q and V columns of the fused qkv
      unscaled (vision_transformer_lora.py L116-119), at rank ``topN`` = 8 (L158; run_vit_lora.sh L4).  At the
      defaults (rank 8, alpha 8) the scale is 1 and the forwards are the same (tested); another rank with alpha left
      at 8 scales the update by ``8 / rank`` where V-PETL's would not.
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
from petl.model.backbone import Backbone, backbone_of
from petl.model.registry import MethodConfig, register_method
from petl.model.wrappers import PetlModule, factory_kwargs
from petl.utils.checks import check_choice, check_dropout, check_range, to_str_tuple

# The targets: q, k and v are rows of the attention's input projection, which the backbone locates (thirds of
# timm's fused qkv, EVA's separate q_proj/k_proj/v_proj, rows of a parallel block's in_proj:
# Backbone.target_rows); the others are whole Linears, but fc1 in a parallel block (rows of in_proj too).
TARGETS = ("q", "k", "v", "proj", "fc1", "fc2")


@dataclass
class LoraConfig(_init.InitOption, MethodConfig):
    """Options of LoRA.

    Attributes:
        rank: inner dimension r of each low-rank update.
        alpha: the update is scaled by ``alpha / rank``, so changing the rank keeps its magnitude.
        dropout: dropout on the LoRA branch's input (train mode only).
        targets: which projections to adapt; any of q, k, v, proj, fc1, fc2.
        init: ``zero`` (petl's default: the model is unchanged at init) or ``reference``: A and B
            trunc_normal(std 0.02), as V-PETL Bench's model constructor leaves them (see
            :mod:`petl.methods._init`).

    """

    rank: int = 8
    alpha: float = 8.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("q", "v")
    init: str = "zero"

    def __post_init__(self) -> None:
        self.targets = to_str_tuple(self.targets, "targets")

    def validate(self, model: nn.Module) -> None:
        super().validate(model)
        check_range("rank", self.rank, low=1)
        if self.alpha <= 0:
            raise ValueError(f"alpha={self.alpha} is out of range: allowed (0, inf)")
        check_dropout("dropout", self.dropout)
        if not self.targets:
            raise ValueError(f"targets is empty: choose one or more of {', '.join(TARGETS)}")
        for target in self.targets:
            check_choice("targets", target, tuple(TARGETS))
        if len(set(self.targets)) != len(self.targets):
            raise ValueError(f"targets={list(self.targets)} names a projection twice")


class LoraLinear(PetlModule):
    """A frozen Linear plus one low-rank update per adapted block of output rows.

    Args:
        base: the Linear to adapt; it stays frozen and is kept as ``base``.
        slices: target name -> (first row, end row) of ``base``'s output that the target updates.
        rank: inner dimension of every update.
        alpha: the updates are scaled by ``alpha / rank``.
        dropout: dropout on the branch input.
        init: ``zero`` (B zero, A kaiming-uniform) or ``reference`` (both trunc_normal std 0.02).

    """

    def __init__(
        self,
        base: nn.Linear,
        slices: dict[str, tuple[int, int]],
        rank: int,
        alpha: float,
        dropout: float,
        init: str = "zero",
    ) -> None:
        super().__init__(base)
        self.slices = dict(sorted(slices.items(), key=lambda item: item[1][0]))
        self.rank = rank
        self.scale = alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        kw = factory_kwargs(base)
        self.lora_a = nn.ParameterDict(
            {name: nn.Parameter(torch.empty(rank, base.in_features, **kw)) for name in self.slices}
        )
        self.lora_b = nn.ParameterDict(
            {name: nn.Parameter(torch.zeros(end - start, rank, **kw)) for name, (start, end) in self.slices.items()}
        )
        for a in self.lora_a.values():
            # The same init nn.Linear gives its weight, as in the LoRA paper's reference code.
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))
        if init == "reference":
            _init.redraw(*self.lora_a.values(), *self.lora_b.values())
        # The stacked A and B of forward without autograd (see _inference_stack).
        self._stack_key: tuple | None = None
        self._stack: tuple[torch.Tensor, torch.Tensor] = ()
        self._stack_params: tuple[nn.Parameter, ...] = ()

    def delta_weight(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The update ``scale * B @ A`` that target ``name`` adds to its rows of ``base.weight`` (in ``dtype``)."""
        return self.scale * (self.lora_b[name].to(dtype) @ self.lora_a[name].to(dtype))

    def stacked_a(self) -> torch.Tensor:
        """Every target's A, one under the other (targets x rank rows): all ranks' inputs in one matmul."""
        a = [self.lora_a[name] for name in self.slices]
        return a[0] if len(a) == 1 else torch.cat(a)

    def stacked_b(self) -> torch.Tensor:
        """Every target's B at its own rows and columns of an (out_features x targets*rank) matrix, zeros elsewhere.

        One op: ``torch.block_diag`` with a zero-column block for each run of rows no target updates (the K
        rows between Q and V), so ``stacked_a`` and ``stacked_b`` give every target's update in two matmuls.
        """
        blocks, row = [], 0
        for name, (start, end) in self.slices.items():
            b = self.lora_b[name]
            if start > row:
                blocks.append(b.new_empty(start - row, 0))
            blocks.append(b)
            row = end
        if row < self.base.out_features:
            blocks.append(b.new_empty(self.base.out_features - row, 0))
        return blocks[0] if len(blocks) == 1 else torch.block_diag(*blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._merged:
            self.check_not_training()
            return self.base(x)
        device = x.device.type
        if torch.is_autocast_enabled(device) and x.is_floating_point():
            # Cast the input once for both matmuls: autocast would cast it (and its gradient back) once per
            # matmul, an activation-sized copy each time.
            x = x.to(torch.get_autocast_dtype(device))
        out = self.base(x)
        if torch.is_grad_enabled() or torch.compiler.is_compiling() or torch.jit.is_tracing():
            return self.add_update(x, out)
        # Without autograd (inference), the update costs two kernels, peft's costs four: one matmul into every
        # target's A and one addmm_ adding every B's rows (the scale as alpha) into the fresh base output, with
        # the stacked A and B kept from the last call while the weights have not changed.  At batch 1 on a GPU a
        # call is bound by the host, so each kernel and each op built in Python counts.
        a, b_t = self._inference_stack(out.dtype)
        z = F.linear(self.dropout(x), a)
        out.view(-1, out.shape[-1]).addmm_(z.view(-1, z.shape[-1]), b_t, alpha=self.scale)
        return out

    def _inference_stack(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``stacked_a()`` and ``stacked_b().t()`` in ``dtype``, built again only when a weight has changed.

        A weight has changed when it was replaced, moved, or written in place (its version counter: optimizer
        steps, ``load_state_dict``, in-place init).  Writes torch does not count (through ``.data``, or a fused
        optimizer step) are seen after the next ``train()`` or ``eval()``, which drops the stack.
        """
        # The ParameterDicts' own dicts (in insertion order, as values()): their public lookups cost more here
        # than the check itself.
        params = (*self.lora_a._parameters.values(), *self.lora_b._parameters.values())
        key = (dtype, *[(id(p), p._version, p.data_ptr()) for p in params])
        if key != self._stack_key:
            with torch.no_grad():
                self._stack = (self.stacked_a().to(dtype), self.stacked_b().to(dtype).t())
            # The parameters stay referenced with the stack, so no other tensor can take their id() meanwhile.
            self._stack_key, self._stack_params = key, params
        return self._stack

    def train(self, mode: bool = True) -> LoraLinear:
        self._stack_key = None
        return super().train(mode)

    def add_update(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` (the frozen layer's output for ``x``) plus every target's low-rank update of its rows."""
        # What the math needs, as peft's ``base(x) + lora_B(lora_A(x)) * scaling``: all A's in one matmul (the
        # input read once), all B's in one addmm that adds straight into the base output with the scale as its
        # alpha.  No slice of the output is copied or updated in place (autograd would clone the whole gradient
        # once per in-place slice update), and the only per-call ops on the tiny A and B are one cat and one
        # block_diag (each B in its own rows and columns), not a pad per target.
        z = F.linear(self.dropout(x), self.stacked_a())
        flat = out.reshape(-1, out.shape[-1])
        update = torch.addmm(flat, z.reshape(-1, z.shape[-1]), self.stacked_b().t(), alpha=self.scale)
        return update.view(out.shape)

    @torch.no_grad()
    def _fold(self, sign: float) -> None:
        # Every row block is computed (in float32 for half-precision weights, so the small update is rounded
        # once, not lost) and checked before any is written: a non-finite update leaves the weight untouched.
        weight = self.base.weight
        dtype = _reparam.work_dtype(weight)
        new = {
            name: (weight[start:end].to(dtype) + sign * self.delta_weight(name, dtype)).to(weight.dtype)
            for name, (start, end) in self.slices.items()
        }
        _reparam.check_finite("LoRA into the weight", *new.values())
        for name, (start, end) in self.slices.items():
            weight[start:end] = new[name]

    def fold(self) -> None:
        """Add every update into its rows of the frozen weight; forward then costs what ``base`` costs."""
        self._fold(+1.0)

    def unfold(self) -> None:
        """Subtract the updates again, restoring the frozen weight (up to rounding)."""
        self._fold(-1.0)


@rows.register_row_hook(LoraLinear)
def _rows(wrapper: LoraLinear) -> rows.RowHook:
    # The frozen qkv/proj/fc runs once for the mixed batch; each task adds its update to its own rows.  Batched,
    # tasks whose stacked A and B have the same shapes (the same total rank: the targets may differ, B places
    # them) stack, the scale folded into B.
    with torch.no_grad():
        batched = rows.low_rank(wrapper.stacked_a(), wrapper.scale * wrapper.stacked_b())

    def add(x: torch.Tensor, y: torch.Tensor, _tokens: rows.Tokens) -> None:
        # Served alone on its rows: the cached inference stack, one matmul and one addmm_ into the rows (eval: no
        # dropout), as forward without autograd.
        a, b_t = wrapper._inference_stack(y.dtype)
        # A's transpose is a view, as F.linear takes it, but the mm is called directly (rows.tokens_linear).
        rows.add_matmul_(y, rows.tokens_linear(x, a.t()), b_t, alpha=wrapper.scale)

    return rows.RowHook(
        wrapper.base, post=lambda x, y, _tokens: wrapper.add_update(x, y), post_in_place=add, batched=batched
    )


def _slices_per_linear(
    bb: Backbone, block: nn.Module, targets: tuple[str, ...]
) -> dict[str, dict[str, tuple[int, int]]]:
    """Linear name -> {target: (first row, end row)} for one block."""
    grouped: dict[str, dict[str, tuple[int, int]]] = {}
    for target in targets:
        linear_name, start, end = bb.target_rows(block, target)
        grouped.setdefault(linear_name, {})[target] = (start, end)
    return grouped


def _formula(model: nn.Module, cfg: LoraConfig) -> int:
    # r * (in + out_slice) per adapted slice: A is r x in, B is out_slice x r.
    bb = backbone_of(model)
    total = 0
    for block in bb.block_list():
        for linear_name, slices in _slices_per_linear(bb, block, cfg.targets).items():
            in_features = bb.linear(block, linear_name).in_features
            total += sum(cfg.rank * (in_features + end - start) for start, end in slices.values())
    return total


# The backbones lora's idea fits: low-rank updates on the fused qkv slices and the other Linears of each block.
BACKBONES = ("vit", "naflexvit", "swin", "swinv2", "swinv2_cr", "vit_relpos", "beit", "eva", "vit_parallel")


@register_method("lora", LoraConfig, trainable_formula=_formula, zero_init=True, mergeable=True, backbones=BACKBONES)
def inject_lora(model: nn.Module, cfg: LoraConfig) -> None:
    """LoRA: low-rank updates on q/k/v slices of the fused qkv, proj, fc1 and/or fc2."""
    bb = backbone_of(model)
    for block in bb.block_list():
        for linear_name, slices in _slices_per_linear(bb, block, cfg.targets).items():
            wrapper = LoraLinear(bb.linear(block, linear_name), slices, cfg.rank, cfg.alpha, cfg.dropout, cfg.init)
            bb.set_linear(block, linear_name, wrapper)


def apply_lora(model: nn.Module, **options: Any) -> nn.Module:
    """Add LoRA to every block of ``model`` and freeze everything else but the head.

    Args:
        model: a timm model of a backbone kind the method supports (its docs page; :func:`petl.list_backbones`).
        **options: fields of :class:`LoraConfig` (``rank``, ``alpha``, ``dropout``, ``targets``,
            ``init``, ``num_classes``); with none, Q and V get rank-8 updates and the head is kept.

    Returns:
        The same model, modified in place.

    """
    return surgery.apply(model, "lora", **options)
