"""NOAH, neural prompt search: per block, a searched mix of visual prompts, LoRA on qkv and an adapter.

Zhang, Zhou and Liu, 2022, "Neural Prompt Search".  Every block ``i`` may get ``prompt[i]`` prompt tokens,
a rank-``lora[i]`` LoRA update of the whole fused qkv and a width-``adapter[i]`` adapter after the MLP; 0
switches a module off in that block.  The widths come from a one-shot search (:mod:`petl.methods.noah_search`):
a supernet holding every module at ``supernet_dim`` is trained with a random subnet per step, then an
evolutionary search picks the subnet with the best held-out accuracy under a parameter limit, and that subnet
is retrained from scratch on the pretrained backbone.  NOAH's published per-task VTAB-1k subnets are presets in
``configs/suites/vtab1k_vpetl.yaml``.

Follows ZhangYuanhan-AI/NOAH@e9c55f3 (V-PETL Bench's ``vision_transformer_noah.py`` is a copy of its VPT-shallow
model, L259, and ``run_vit_noah.sh`` runs its adapter trainer, so its NOAH row is NOAH's own):

* block: model/supernet_vision_transformer_timm.py L354-366: own prompts (dropout 0.1, a mask per image: L357-359
  expand them to the batch first) appended at the END of the sequence, replacing the previous block's prompts
  when that block had some (L360-363; when a block has none the
  earlier prompts stay in the sequence and the next prompted block appends after them, which petl keeps);
  ``x + attn(norm1(x))``; ``x + adapter(drop_path(mlp(norm2(x))))``;
* LoRA: L221-228 and L272-281: ``qkv += B A dropout(x)`` for q, k and v, no scaling, input dropout 0.1
  (``--drop_rate_LoRA``, supernet_train_prompt.py L207);
* adapter: model/module/adapter_super.py L12-74: ``h + up(dropout(QuickGELU(down(h))))``, dropout 0.1;
* init: what NOAH's modules write, as slices of the supernet's ``supernet_dim``-wide modules (L317-319: prompts
  xavier over the whole ``[1, supernet_dim, dim]`` tensor; L224-228: LoRA A kaiming-uniform, B zero;
  adapter_super.py L38-45: adapters xavier-uniform, biases normal(std 1e-6), so NOAH is not the identity at init;
  the retrain configs keep SUPERNET widths 100, experiments/NOAH/subnet/VTAB/*.yaml).  That is NOT how NOAH's code
  starts training: the model's constructor then calls ``init_weights`` (L462, L520-531), whose
  ``_init_vit_weights`` (L664-688) re-draws every nn.Linear, LoRA A and B and both adapter projections included,
  trunc_normal(std 0.02) with zero biases, so LoRA B starts non-zero; only the prompts (bare Parameters) keep
  theirs.  ``init=reference`` reproduces that draw (:mod:`petl.methods._init`), for the reproduction preset
  (configs/suites/vtab1k_vpetl.yaml); petl's default ``init=zero`` keeps the module inits, LoRA B zero, as for
  LoRA and the adapters;
* the model-level prompts of L449-455 and L635-640 are appended before the first block and replaced by block 0's
  own at once (L605: block 0's "previous" width is its own), so they never reach the output; petl leaves them out,
  and from NOAH's own count (``get_sampled_params_numel``, L609-623, which also counts their 100-row position
  embedding), which is why petl's counts are lower (configs/experiments/noah.yaml);
* the head reads the class token after the final norm (L642-646); petl removes the prompts after the last block,
  so an average-pooling backbone averages its patch tokens only.

On ``vit_relpos``, BEiT and EVA the trailing prompts get no position: the frozen attention zero-pads its
relative-position bias or gives them no rotation for as many tokens as trail the sequence in each block
(:meth:`petl.Backbone.make_room` at the end of the sequence), so their number may change from block to block and,
in the search, from step to step.  LoRA wraps the fused ``qkv`` (BEiT's and EVA's ``q_bias``/``v_bias`` are added
after it); an EVA-02 with separate q/k/v is refused in one line unless every ``lora`` width is 0.  A
:class:`petl.MultiTask` mixed batch serves it on these families: its prompts sit in the batch's prompt slots, for
which the shared blocks make the same room.

Trains:
    NOAH: per block prompts appended after the patches (replacing the previous block's), a LoRA update of the
    whole qkv (no scaling) and an adapter after the MLP (QuickGELU); not unchanged at init (xavier adapter, as NOAH's
    adapter code writes; LoRA B starts at zero as its LoRA code writes, but NOAH's constructor then re-draws LoRA A and
    B and the adapters trunc_normal(0.02), which ``init=reference`` reproduces).

    ``prompt``, ``lora``, ``adapter`` all empty: ``petl-run`` searches them on the train split before training, NOAH's
    one-shot supernet + evolution in ``petl.methods.noah_search``, and records them in ``result.json``; ``petl-bench``
    searches once per task, as NOAH's scripts do, and the task's other trials and seeds retrain that subnet
    (``calibrate_once`` in ``configs/experiments/noah.yaml``); from Python call
    ``petl.methods.noah_search.calibrate_noah(backbone, cfg, loader)`` first, as ``petl.apply`` alone uses width 5
    everywhere, a data-free placeholder.  NOAH's 19 published VTAB-1k subnets are per-task presets in
    ``configs/suites/vtab1k_vpetl.yaml``.  A search killed part-way resumes where it stopped, choosing the same subnet
    (its progress, saved at most once a minute, lies in ``noah_search/`` of petl's cache folder until the search ends).
    Search cost on one mini task: ``benchmarks/results/noah_search_cpu.md`` (measured on one thread at 10 supernet
    epochs and 60 scored subnets, 3.7 CPU minutes; NOAH's budget extrapolated to about 2.3 CPU hours, the mini
    leaderboard's 100 supernet epochs to about 0.7 a task).

Reference:
    - ZhangYuanhan-AI/NOAH@e9c55f3 model/supernet_vision_transformer_timm.py L221-228, L272-281, L354-366,
      L449-462, L520-531, L605-646, L664-688; model/module/adapter_super.py L12-74; lib/datasets.py L21-31

Differences:
    - The model-level prompts, replaced by block 0's before they act, are left out (and from the count):
      ``inject_noah`` against ``model/supernet_vision_transformer_timm.py`` L449-455, L605,
      L635-640.
    - Prompts are removed after the last block, so an average-pooling backbone pools patches only (on a class-token
      backbone the logits are the same): ``wire`` against
      ``model/supernet_vision_transformer_timm.py`` L642-646.
    - The search holds out every fifth training image; NOAH trains the supernet on train800 and scores on val200:
      ``petl.methods.noah_search.HELD_OUT_EVERY`` against ``lib/datasets.py`` L21-31.
    - re-draw: yes, ``init_weights`` re-draws LoRA A and B and both adapter projections trunc_normal(0.02) with zero
      biases (prompts keep xavier), so LoRA B starts non-zero.  ``init=zero`` (default) keeps the module inits, as for
      LoRA and the adapters; ``init=reference`` reproduces the re-draw (supernet included) and the ``vtab1k_vpetl``
      NOAH rows use it: ``NoahConfig.init``, ``NoahQkv.__init__``, ``NoahBlock.__init__`` against
      ``model/supernet_vision_transformer_timm.py`` L224-228, L462, L520-531, L664-688;
      ``model/module/adapter_super.py`` L38-45.
    - The fresh head is PyTorch's default Linear, where NOAH's ``reset_classifier``
      (``model/supernet_vision_transformer_timm.py`` L551-555) draws it trunc_normal(0.02).
    - Prompt dropout is drawn per image, as NOAH expands the prompts to the batch before the dropout (L357-359;
      tested).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from timm.layers import QuickGELU
from torch import nn

from petl.methods import _init
from petl.model import rows, surgery
from petl.model.backbone import backbone_of, block_family
from petl.model.registry import MethodConfig, register_method
from petl.model.wrappers import PetlModule, factory_kwargs
from petl.utils.checks import as_list, check_dropout, check_range

# NOAH's VTAB-1k search space (experiments/NOAH/supernet/supernet-B_prompt_VTAB.yaml): widths per module,
# and how many leading blocks (a quarter, half, three quarters or all of ViT-B's 12) carry each module.
SEARCH_WIDTHS = (1, 5, 10)
DEPTH_FRACTIONS = (0.25, 0.5, 0.75, 1.0)
# The placeholder subnet without a search: the middle width in every block.
PLACEHOLDER_WIDTH = 5


def widths_text(value: Any, field: str = "widths") -> str:
    """Per-block widths (a list of ints, or a comma-separated string) as the canonical ``"10,5,1"``."""
    wanted = 'comma-separated whole numbers, one per block, e.g. "10,5,1"'
    items = (
        [v for v in value.replace(" ", "").split(",") if v] if isinstance(value, str) else as_list(value, field, wanted)
    )
    try:
        # A bool or 2.5 would pass int() as 1 or 2: only whole numbers (as numbers or digits) are widths.
        if any(isinstance(v, bool) or (isinstance(v, float) and not v.is_integer()) for v in items):
            raise ValueError(f"{value!r}")
        return ",".join(str(int(v)) for v in items)
    except (TypeError, ValueError):
        raise ValueError(f"{field}={value!r} is not {wanted}") from None


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",")) if text else ()


@dataclass
class NoahConfig(_init.InitOption, MethodConfig):
    """Options of NOAH.

    Attributes:
        prompt: per block, the prompt tokens it adds (0: none), as ``"10,5,1,..."`` (from Python a list of
            ints is accepted too; on the command line quote the string, ``'method.prompt="10,5,1,..."'``, as
            Hydra reads a bare ``10,5,1`` as a sweep and ``[10,5,1]`` as a list).
        lora: per block, the rank of its LoRA update of qkv (0: none), written as ``prompt``.
        adapter: per block, the width of its adapter after the MLP (0: none), written as ``prompt``.
            Given one of the three, an empty other is off in every block.  With all three empty the
            subnet is searched on the task by ``petl-run`` (:func:`petl.methods.noah_search.calibrate_noah`);
            :func:`petl.apply` alone uses a data-free placeholder, width 5 for every module in every block, which
            is NOT a searched subnet.
        supernet_dim: width of the supernet every module is a slice of; its init scales follow it (NOAH: 100).
        dropout: dropout on the prompts, the LoRA input and inside the adapter (NOAH: 0.1 each).
        init: ``zero`` (petl's default) starts the modules as NOAH's module code writes them: LoRA A
            kaiming-uniform and B zero, adapters xavier-uniform with normal(std 1e-6) biases, prompts
            xavier-uniform.  ``reference`` starts them as NOAH's code really runs: its constructor then calls
            ``init_weights`` (L462), which re-draws every nn.Linear, LoRA A and B and both adapter projections,
            trunc_normal(std 0.02) with zero biases (L520-531, ``_init_vit_weights`` L664-688); the prompts,
            bare Parameters, keep their xavier init (see :mod:`petl.methods._init`), so ``reference`` is refused
            when ``lora`` and ``adapter`` are off (0) in every block.
        search_epochs: supernet training epochs of the search (NOAH: 500 on train800).
        search_generations: evolution generations (NOAH's VTAB script: 15).
        population: candidates per generation (NOAH: 50).
        max_params: the search keeps subnets with at most this many trainable parameters (NOAH's default
            limit 0.64M, here on petl's count: see configs/experiments/noah.yaml).  The four search options act
            only in a search; with the widths given they record the search that chose them (as petl-run records a
            searched config, and a benchmark run reuses it), and a subnet above ``max_params`` is refused.

    """

    prompt: str = ""
    lora: str = ""
    adapter: str = ""
    supernet_dim: int = 100
    dropout: float = 0.1
    init: str = "zero"
    search_epochs: int = 500
    search_generations: int = 15
    population: int = 50
    max_params: int = 640_000

    def __post_init__(self) -> None:
        self.prompt, self.lora, self.adapter = (
            widths_text(self.prompt, "prompt"),
            widths_text(self.lora, "lora"),
            widths_text(self.adapter, "adapter"),
        )

    @property
    def searched(self) -> bool:
        """Whether the per-block widths are given (rather than to be searched)."""
        return bool(self.prompt or self.lora or self.adapter)

    def widths(self, model: nn.Module) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """(prompt, lora, adapter) per block: the options, or the placeholder."""
        depth = backbone_of(model).depth()
        if self.searched:  # a module left empty is off in every block
            return tuple(_ints(w) or (0,) * depth for w in (self.prompt, self.lora, self.adapter))
        return ((PLACEHOLDER_WIDTH,) * depth,) * 3

    def validate(self, model: nn.Module) -> None:
        bb = backbone_of(model)
        super().validate(model)
        depth = bb.depth()
        check_range("supernet_dim", self.supernet_dim, low=1)
        check_dropout("dropout", self.dropout)
        for name in ("search_epochs", "search_generations", "population", "max_params"):
            check_range(name, getattr(self, name), low=1)
        if any(self.widths(model)[1]):
            for block in bb.block_list():
                try:
                    bb.linear(block, "qkv")
                except ValueError as error:  # an EVA-02 with separate q/k/v
                    raise ValueError(f"NOAH's LoRA updates one fused qkv Linear, and {error}") from None
        if not self.searched:
            return
        for name, widths in zip(("prompt", "lora", "adapter"), self.widths(model), strict=True):
            if len(widths) != depth:
                raise ValueError(f"{name} lists {len(widths)} blocks; the model has {depth}: give one width per block")
            if min(widths) < 0 or max(widths) > self.supernet_dim:
                raise ValueError(f"{name}={list(widths)}: widths must lie in [0, supernet_dim={self.supernet_dim}]")
        prompts, ranks, adapters = self.widths(model)
        if not any(prompts + ranks + adapters):
            raise ValueError(
                "prompt, lora and adapter are off (0) in every block: NOAH would train the head alone; give a width "
                "above 0, or leave all three empty for a search"
            )
        if self.init == "reference" and not any(ranks + adapters):
            # The reference's re-draw reaches the LoRA and adapter Linears only; the prompts keep their init.
            raise ValueError(
                "init=reference re-draws NOAH's LoRA and adapters, and lora and adapter are off (0) in every block "
                "(the prompts start the same either way): drop init=reference"
            )
        for block in bb.block_list():
            block_family(block)
        # The search options stay with given widths: they record the search that chose them (petl-run's searched
        # config, a benchmark run reusing that search).  A subnet larger than max_params no search could have kept.
        count = subnet_params(bb.width(), *self.widths(model))
        if count > self.max_params:
            raise ValueError(
                f"max_params={self.max_params} is below the given subnet's {count:,} parameters: max_params acts "
                "only in a search (prompt, lora and adapter empty), which keeps no subnet above it; raise it or drop it"
            )


class NoahQkv(PetlModule):
    """The fused qkv Linear plus ``B[:, :r] A[:r] dropout(x)`` (no scaling), r the active rank."""

    def __init__(self, base: nn.Linear, rank: int, dropout: float, init: str = "zero") -> None:
        super().__init__(base)
        kw = factory_kwargs(base)
        self.rank = rank
        self.lora_a = nn.Parameter(torch.empty(rank, base.in_features, **kw))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank, **kw))
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))
        if init == "reference":  # LoRA_a and LoRA_b are nn.Linears there, re-drawn by init_weights (L462)
            _init.redraw(self.lora_a, self.lora_b)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        return out if self.rank == 0 else out + self.update(x)

    def update(self, x: torch.Tensor) -> torch.Tensor:
        """The LoRA update ``B[:, :r] A[:r] dropout(x)`` alone."""
        return F.linear(F.linear(self.dropout(x), self.lora_a[: self.rank]), self.lora_b[:, : self.rank])


@rows.register_row_hook(NoahQkv)
def _qkv_rows(wrapper: NoahQkv) -> rows.RowHook:
    # The frozen qkv once for the batch, each task's update on its rows: served (eval: no dropout), one matmul and
    # one addmm_ into the rows; batched, a low-rank update (no scale) that stacks with LoRA's and FacT's.
    if not wrapper.rank:
        return rows.RowHook(wrapper.base)
    with torch.no_grad():
        a, b = wrapper.lora_a[: wrapper.rank], wrapper.lora_b[:, : wrapper.rank]
        # A and B transposed once, as tokens_linear and add_matmul_ take them
        like, batched = rows.per_device(a.t(), b.t()), rows.low_rank(a, b)

    def add(x: torch.Tensor, y: torch.Tensor, _tokens: rows.Tokens) -> None:
        a_t, b_t = like(y)
        rows.add_matmul_(y, rows.tokens_linear(x, a_t), b_t)

    return rows.RowHook(
        wrapper.base, post=lambda x, y, _tokens: y + wrapper.update(x), post_in_place=add, batched=batched
    )


class NoahBlock(PetlModule):
    """A frozen pre-norm block with NOAH's prompts, adapter and (through :class:`NoahQkv`) LoRA.

    The active widths (``prompt_len``, ``adapter_dim``, the qkv wrapper's ``rank``) may be smaller than the
    tensors, which the search's supernet uses; a retrained subnet's tensors are exactly its widths.

    Args:
        base: the timm Block; it stays frozen and is kept as ``base``.
        d: the token width.
        prompt: prompt tokens, adapter width and LoRA rank of this block (tensor sizes).
        supernet_dim: the supernet width whose slices the inits are.
        dropout: NOAH's dropout on prompts, LoRA input and adapter.
        init: ``zero`` or ``reference`` (:class:`NoahConfig`).

    """

    prompt_place = "end"  # NOAH's prompts trail the sequence (see petl.model.timm_api)

    def __init__(
        self,
        base: nn.Module,
        d: int,
        prompt: int,
        adapter: int,
        lora: int,
        supernet_dim: int,
        dropout: float,
        init: str = "zero",
    ) -> None:
        family = block_family(base)
        super().__init__(base)
        self.family = family
        kw = factory_kwargs(base)
        self.prompt_len, self.adapter_dim = prompt, adapter
        # Set by wire(): how many trailing prompt tokens this block replaces, and strips after itself; where its
        # prompts start among the trailing ones, and how many trail the sequence it attends.
        self.replace, self.strip, self.start, self.tail = 0, 0, 0, 0
        self.drop_prompt, self.drop_adapter = nn.Dropout(dropout), nn.Dropout(dropout)
        self.prompt = None
        if prompt > 0:
            # xavier-uniform over NOAH's [1, supernet_dim, d] tensor: fan_in supernet_dim*d, fan_out d.
            bound = math.sqrt(6.0 / ((supernet_dim + 1) * d))
            self.prompt = nn.Parameter(torch.empty(prompt, d, **kw).uniform_(-bound, bound))
        self.down = self.up = None
        if adapter > 0:
            bound = math.sqrt(6.0 / (d + supernet_dim))  # xavier over the [supernet_dim, d] / [d, supernet_dim] Linears
            self.down = nn.Linear(d, adapter, **kw)
            self.up = nn.Linear(adapter, d, **kw)
            with torch.no_grad():
                for linear in (self.down, self.up):
                    linear.weight.uniform_(-bound, bound)
                    linear.bias.normal_(std=1e-6)
            if init == "reference":
                _init.redraw(self.down, self.up)
        self.act = QuickGELU()  # x * sigmoid(1.702 x), NOAH's adapter activation (adapter_super.py L8-10)
        if lora > 0:
            family.set_linear(base, "qkv", NoahQkv(family.linear(base, "qkv"), lora, dropout, init))

    def adapter(self, h: torch.Tensor) -> torch.Tensor:
        """NOAH's adapter: ``h + up(dropout(QuickGELU(down(h))))`` at the active width."""
        if self.adapter_dim == 0:
            return h
        a = self.adapter_dim
        z = self.drop_adapter(self.act(F.linear(h, self.down.weight[:a], self.down.bias[:a])))
        return h + F.linear(z, self.up.weight[:, :a], self.up.bias)

    def prompts(self, x: torch.Tensor) -> torch.Tensor:
        """This block's active prompts for every row of ``x``, in its dtype, dropout drawn per row.

        Expanded to the batch before the dropout, so each image gets its own mask (L357-359).
        """
        return self.drop_prompt(self.prompt[: self.prompt_len].to(x.dtype).expand(x.shape[0], -1, -1))

    def forward(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        if self.prompt_len > 0:
            x = torch.cat([x[:, : x.shape[1] - self.replace], self.prompts(x)], dim=1)
        x = self.family.attn_residual(self.base, x, **kwargs)
        x = x + self.adapter(self.family.mlp_branch(self.base, x))
        return x[:, : x.shape[1] - self.strip] if self.strip else x


def wire(blocks: list[NoahBlock]) -> None:
    """Set each block's ``replace`` and the last block's ``strip`` from the active prompt lengths (L354-363).

    Also each block's ``start`` (where its prompts go among the trailing prompt tokens) and ``tail`` (how many
    trail the sequence it runs on), which a :class:`petl.MultiTask` mixed batch lays out in its prompt slots.
    """
    carried, previous = 0, 0
    for block in blocks:
        block.strip = 0
        block.replace = previous if block.prompt_len > 0 else 0
        block.start = carried - block.replace
        if block.prompt_len > 0:
            carried += block.prompt_len - block.replace
        block.tail = carried
        previous = block.prompt_len
    blocks[-1].strip = carried


def _served_adapter(wrapper: NoahBlock) -> Callable[[torch.Tensor, rows.Tokens], None]:
    """The adapter in eval added into the rows' MLP branch in place, in fewer ops (dropout off, QuickGELU as one SiLU).

    ``x * sigmoid(1.702 x)`` is ``silu(1.702 x) / 1.702``: the 1.702 goes into ``down``, the 1/1.702 into ``up``, whose
    bias rides on one more unit of ``down`` (silu(2^14) is 2^14: :func:`petl.model.rows.with_bias_unit`), so that
    ``up`` and the add into the rows are one ``addmm_``: down, SiLU, addmm_.  The same function, up to rounding (as
    Convpass's served bypass).
    """
    k, a = 1.702, wrapper.adapter_dim
    with torch.no_grad():
        down, up = wrapper.down, wrapper.up
        unit = rows.with_bias_unit(k * down.weight[:a], k * down.bias[:a], up.weight[:, :a] / k, up.bias, F.silu)
    down_w, down_b, up_w = unit
    like = rows.per_device(down_w.t(), down_b, up_w.t())  # transposed once, as tokens_linear and add_matmul_ take them

    def add(h: torch.Tensor, _tokens: rows.Tokens) -> None:
        down_t, down_b, up_t = like(h)
        rows.add_matmul_(h, F.silu(rows.tokens_linear(h, down_t, down_b)), up_t)

    return add


@rows.register_row_hook(NoahBlock)
def _block_rows(wrapper: NoahBlock) -> rows.RowHook:
    # NOAH's trailing prompts live in the batch's prompt slots (a token is attended wherever it sits in the
    # sequence): the block writes its prompts at ``start``, its tokens attend the first ``tail`` slots, and the
    # pooling never sees them (stripped after the last block).  The adapter acts on the MLP's branch.  Served (eval:
    # no dropout), the prompts are cast once per device and dtype, not at every call.
    pre = None
    if wrapper.prompt_len > 0:
        like = rows.per_device(wrapper.prompt[: wrapper.prompt_len])

        def pre(x: torch.Tensor, tokens: rows.Tokens) -> torch.Tensor:
            first = tokens.prefix + wrapper.start
            prompts = like(x)[0].expand(x.shape[0], -1, -1)
            return torch.cat([x[:, :first], prompts, x[:, first + wrapper.prompt_len :]], dim=1)

    adapter = wrapper.adapter_dim > 0
    return rows.RowHook(
        wrapper.base,
        pre=pre,
        branch=(lambda h, _tokens: wrapper.adapter(h)) if adapter else None,
        branch_in_place=_served_adapter(wrapper) if adapter else None,
        prompts=wrapper.tail,
        visible=wrapper.tail,
        pool_prompts=False,
    )


def noah_blocks(model: nn.Module) -> list[NoahBlock]:
    """The model's NOAH blocks, in order."""
    return [b for b in backbone_of(model).block_container() if isinstance(b, NoahBlock)]


def subnet_params(dim: int, prompt: Iterable[int], lora: Iterable[int], adapter: Iterable[int]) -> int:
    """Trainable parameters of a subnet on blocks of width ``dim`` (the closed form of NOAH's modules)."""
    total = sum(p * dim for p in prompt) + sum(r * 4 * dim for r in lora)
    return total + sum(2 * dim * a + a + dim for a in adapter if a > 0)


def _formula(model: nn.Module, cfg: NoahConfig) -> int:
    return subnet_params(backbone_of(model).width(), *cfg.widths(model))


def inject_noah(model: nn.Module, cfg: NoahConfig) -> None:
    """NOAH: per block, prompts, LoRA on qkv and an adapter of the searched widths."""
    bb = backbone_of(model)
    container, d = bb.block_container(), bb.width()
    for i, (p, r, a) in enumerate(zip(*cfg.widths(model), strict=True)):
        bb.set_block(i, NoahBlock(container[i], d, p, a, r, cfg.supernet_dim, cfg.dropout, cfg.init))
    for block in bb.block_list():
        # The prompts trail the sequence without a position: no relative-position bias, no rotation.
        bb.make_room(block, bb.num_tokens())
    wire(noah_blocks(model))


# The backbones noah's idea fits: prompt tokens appended to a flat token sequence, adapters and LoRA on pre-norm
# blocks of one width.
BACKBONES = ("vit", "naflexvit", "vit_relpos", "beit", "eva")
# Why not on the other backbone kinds (the refusal says it, and so does the docs page).
REFUSAL = "its prompts are appended to one flat token sequence (VPT's layout), and a Swin attends in windows of a grid"
REFUSALS = {
    "vit_parallel": "its adapter follows the MLP between two residual halves and its LoRA spans a fused qkv, and a "
    "parallel block has one residual and keeps qkv in in_proj beside fc1"
}


# Its calibration, the subnet search, registers itself from petl.methods.noah_search (which builds on this file).
register_method(
    "noah",
    NoahConfig,
    trainable_formula=_formula,
    backbones=BACKBONES,
    refusal=REFUSAL,
    refusals=REFUSALS,
    refusal_for=("swin", "swinv2", "swinv2_cr"),
)(inject_noah)


def apply_noah(model: nn.Module, **options: Any) -> nn.Module:
    """Add NOAH's modules to ``model`` and freeze everything else but the head.

    Args:
        model: a timm model of a backbone kind the method supports (its docs page; :func:`petl.list_backbones`).
        **options: fields of :class:`NoahConfig` (``prompt``, ``lora``, ``adapter``: one width per block;
            ``supernet_dim``, ``dropout``, ``init``, the search budget (``search_epochs``, ``search_generations``,
            ``population``, ``max_params``, which the calibration step
            :func:`petl.methods.noah_search.calibrate_noah` reads), ``num_classes``).

    Returns:
        The same model, modified in place.

    """
    return surgery.apply(model, "noah", **options)
