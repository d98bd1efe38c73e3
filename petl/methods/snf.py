"""SNF, shortcut adaptation via normalizing flow (Wang et al., CVPR 2023): a flow on each residual shortcut.

In every block both shortcuts, the identity around the attention and the one around the MLP, become a small
normalizing flow of the tokens: ``x = flow_attn(x) + attn(norm1(x))``, then ``x = flow_mlp(x) + mlp(norm2(x))``.
A flow is a per-channel affine map ``mu + exp(log_sigma) * z`` followed by ``flow_length`` planar flows
``z + u * tanh(z . w + b)`` (per step a direction ``w``, a scale ``u`` and a bias ``b``).  Only the flows train.

Follows Wang-Yaoming/SNF@a6f85b1: flow.py L7-30 (``NormalizingFlow``: the affine transform, then the planar
flows in order), L32-41 (``AffineTransform``: ``mu`` and ``logsigma`` start at zero), L43-64 (``PlanarFlow``:
``weight``, ``scale`` and ``bias`` drawn uniform(-0.01, 0.01), ``z + scale * tanh(linear(z))``); snf.py L11-18
(the block: each shortcut replaced by the flow's output, the log-Jacobian returned by the flow unused), L47-57
(``set_snf``: two flows per block, ``flow_length`` 16, width 768).  V-PETL Bench publishes an SNF row but has
no SNF code.

Not unchanged at init: the planar flows start at small random values, as the reference's (about 1e-4 off the
identity); ``flow_length=0`` (the affine maps alone) starts as the identity.  Not mergeable: tanh is not linear.
The block forward the reference binds reads CLIP's names (``ln_1``, ``attention``, snf.py L13-16), also on the
timm blocks it patches (L51); petl runs timm's ``norm1``/``attn``/``norm2``/``mlp`` with their layer scale and drop
path.  Deliberate differences: flows on every block (the reference stops after the first 12, all of ViT-B's);
the flows' width is the backbone's (the reference's ``flow_dim`` 768); the log-Jacobian the reference computes
and discards is not computed.

Speed: a shortcut's planar flows are stored stacked (:class:`PlanarChain`, the reference's modules as rows) and
run as one autograd function (:class:`PlanarFlows`) that computes every flow's pre-activation from the chain's
input with two matrix products and a ``K x K`` mixing matrix, so the part that must go flow by flow works on
``K`` values per token instead of the ``d``-wide tokens; its backward walks that recurrence back by hand and
keeps the input and one tanh value per token and flow, where autograd would keep a copy of the tokens after
every flow.  The same values and gradients as the flows one by one (to float rounding, tested against autograd
through the flows written out), at a fraction of their time and memory (``benchmarks/results/speed_cpu.md``).
It computes in the tokens' dtype with autocast off, so a model under bf16 autocast trains its flows in float32.

On ``vit_relpos``, BEiT and EVA the two flows replace the shortcuts of the family's two residual halves
(:meth:`petl.Backbone.attn_branch`, :meth:`petl.Backbone.mlp_branch`: BEiT's and EVA's ``gamma`` layer scales stay
inside the branches).  A parallel block has one residual: refused there.

Trains:
    SNF: both residual shortcuts of every block become a normalizing flow of the tokens (a per-channel affine
    map ``mu + exp(log_sigma) * x``, then ``flow_length`` planar flows ``z + u * tanh(z . w + b)``); planar flows drawn
    uniform(-0.01, 0.01) as in the reference, so not unchanged at init (``flow_length=0`` is); not mergeable (tanh).

    A shortcut's 16 planar flows are stored stacked and train as one autograd node with a hand-written backward (the
    same values and gradients, tested; 1.17x LoRA's step and 1.11x its memory in ``speed_cpu.md``, against 3.5x and
    6.4x for the flows as 16 autograd modules).  627,072 on ViT-B/16 at the code's default; V-PETL publishes 0.25M,
    the paper 0.036M (the affine maps alone count 36,864; ``configs/experiments/snf.yaml`` says why no flow length
    gives 0.25M).

Reference:
    - Wang-Yaoming/SNF@a6f85b1 flow.py L7-64; snf.py L11-18, L47-57

Differences:
    - Flows on every block (the reference stops after 12, all of ViT-B's), as wide as the backbone (the
      reference's ``flow_dim`` 768): ``inject_snf`` against ``snf.py`` L47, L53.
    - The log-Jacobian, computed and discarded there, is not computed; timm's ``norm1``/``attn``/``norm2``/``mlp``
      run with their layer scale and drop path (the bound forward reads CLIP's ``ln_1``/``attention``):
      ``ShortcutFlow``, ``SnfBlock.forward`` against ``flow.py`` L16-30, ``snf.py`` L11-18.
    - re-draw: none.  ``set_snf`` patches a built model and the repository ships no constructor or training script
      after it (``snf.py`` L47-57).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from petl.model import rows, surgery
from petl.model.backbone import backbone_of, block_family
from petl.model.registry import MethodConfig, register_method
from petl.model.wrappers import PetlModule, factory_kwargs
from petl.utils.checks import check_range


@dataclass
class SnfConfig(MethodConfig):
    """Options of SNF.

    Attributes:
        flow_length: planar flows after the affine map in each shortcut's flow (``flow_length``, 16).

    """

    flow_length: int = 16

    @property
    def keeps_zero_init(self) -> bool:
        # The affine maps start as the identity; the planar flows start at small random values (the reference's).
        return self.flow_length == 0

    def validate(self, model: nn.Module) -> None:
        super().validate(model)
        check_range("flow_length", self.flow_length, low=0)
        for block in backbone_of(model).block_list():
            block_family(block)


class PlanarFlows(torch.autograd.Function):
    """``K`` planar flows in order, ``z <- z + scale[k] * tanh(z . weight[k] + bias[k])``, in a fused autograd node.

    Flow ``k`` only adds ``scale[j] * tanh_j`` for each earlier flow ``j`` to the chain's input ``z0``, so its
    pre-activation is ``z0 . weight[k] + bias[k] + sum_{j<k} tanh_j * (scale[j] . weight[k])``: one matrix
    product ``z0 @ weight.T`` and a ``K x K`` mixing matrix ``scale @ weight.T`` give every pre-activation, and the
    loop over the flows runs on ``K`` values per token instead of the ``d``-wide tokens; the output is
    ``z0 + tanh @ scale``.  The backward walks the same recurrence back.  The values are the flows' in order, to
    float rounding (tested against autograd through the flows written out), and autograd would instead keep a copy
    of the tokens after every flow: this keeps the input and the ``K`` tanh values per token.
    """

    @staticmethod
    def forward(
        ctx: Any, z: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor
    ) -> torch.Tensor:
        """Apply the flows to ``z`` (..., d) with ``weight`` and ``scale`` (K, d) and ``bias`` (K,)."""
        with torch.autocast(z.device.type, enabled=False):
            shape, param_dtype = z.shape, weight.dtype
            weight, scale, bias = (t.to(z.dtype) for t in (weight, scale, bias))
            z = z.reshape(-1, shape[-1])
            pre = torch.addmm(bias[:, None], weight, z.T)  # (K, N): z0 . weight[k] + bias[k]
            mix = scale @ weight.T  # (K, K): scale[j] . weight[k]
            tanh = torch.empty_like(pre)
            for k in range(len(weight)):
                torch.tanh(torch.addmv(pre[k], tanh[:k].T, mix[:k, k]), out=tanh[k])
            out = torch.addmm(z, tanh.T, scale)
        ctx.save_for_backward(z, tanh, weight, scale, mix)
        ctx.shape, ctx.param_dtype = shape, param_dtype
        return out.view(shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Walk the recurrence back from the last flow, then through the two matrix products."""
        z, tanh, weight, scale, mix = ctx.saved_tensors
        with torch.autocast(grad.device.type, enabled=False):
            grad = grad.reshape(z.shape).to(z.dtype)
            grad_tanh = scale @ grad.T  # (K, N), the output's share; earlier flows gain the later ones' below
            grad_pre = torch.empty_like(tanh)
            for k in reversed(range(len(weight))):
                torch.mul(grad_tanh[k], 1 - tanh[k] * tanh[k], out=grad_pre[k])
                grad_tanh[:k].addr_(mix[:k, k], grad_pre[k])
            grad_mix = (tanh @ grad_pre.T).triu_(1)  # only mix[j, k] with j < k was used
            grad_z = torch.addmm(grad, grad_pre.T, weight)
            grad_weight = torch.addmm(grad_pre @ z, grad_mix.T, scale)
            grad_scale = torch.addmm(tanh @ grad, grad_mix, weight)
            grad_bias = grad_pre.sum(1)
        dtype = ctx.param_dtype
        return grad_z.view(ctx.shape), grad_weight.to(dtype), grad_scale.to(dtype), grad_bias.to(dtype)


class PlanarChain(nn.Module):
    """``length`` planar flows in order; flow ``k`` is row ``k`` of ``weight``, ``scale`` and ``bias``.

    The reference's ``PlanarFlow`` modules stacked (their tensors drawn uniform(-0.01, 0.01) as there), so the
    chain runs as one :class:`PlanarFlows` and the optimizer sees three tensors instead of three per flow.

    Args:
        width: the token width d.
        length: the number of planar flows (at least 1).
        kw: device and dtype of the new tensors.

    """

    def __init__(self, width: int, length: int, **kw: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(length, width, **kw).uniform_(-0.01, 0.01))
        self.scale = nn.Parameter(torch.empty(length, width, **kw).uniform_(-0.01, 0.01))
        self.bias = nn.Parameter(torch.empty(length, **kw).uniform_(-0.01, 0.01))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return PlanarFlows.apply(z, self.weight, self.scale, self.bias)


class ShortcutFlow(nn.Module):
    """A normalizing flow of tokens: ``mu + exp(log_sigma) * z`` (both start at zero), then ``length`` planar flows.

    Args:
        width: the token width d.
        length: the number of planar flows (0: the affine map alone).
        kw: device and dtype of the new tensors.

    """

    def __init__(self, width: int, length: int, **kw: Any) -> None:
        super().__init__()
        self.mu = nn.Parameter(torch.zeros(width, **kw))
        self.log_sigma = nn.Parameter(torch.zeros(width, **kw))
        self.planar = PlanarChain(width, length, **kw) if length else nn.Identity()

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.planar(self.mu + self.log_sigma.exp() * z)


class SnfBlock(PetlModule):
    """A frozen pre-norm timm block whose two shortcuts are normalizing flows.

    Args:
        base: the timm ``Block``; it stays frozen and is kept as ``base``.
        width: the token width.
        cfg: the method's options.

    """

    def __init__(self, base: nn.Module, width: int, cfg: SnfConfig) -> None:
        family = block_family(base)
        super().__init__(base)
        self.family = family
        kw = factory_kwargs(base)
        self.flow_attn = ShortcutFlow(width, cfg.flow_length, **kw)
        self.flow_mlp = ShortcutFlow(width, cfg.flow_length, **kw)

    def forward(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        block, family = self.base, self.family
        x = self.flow_attn(x) + family.attn_branch(block, x, **kwargs)
        return self.flow_mlp(x) + family.mlp_branch(block, x)


@rows.register_row_hook(SnfBlock)
def _rows(wrapper: SnfBlock) -> rows.RowHook:
    # The frozen block runs once for the mixed batch as its two residual halves, x + attn and h + mlp; each task
    # swaps the identity shortcut in its rows for its flow.  pre keeps the rows' block input for mid (each task's
    # rows are one contiguous group, served pre -> mid -> post in one forward).
    held: dict[str, torch.Tensor] = {}

    def pre(x: torch.Tensor, _tokens: rows.Tokens) -> None:
        held["x"] = x

    def mid(h: torch.Tensor, _tokens: rows.Tokens) -> torch.Tensor:
        x = held.pop("x")
        return wrapper.flow_attn(x) + (h - x)

    return rows.RowHook(wrapper.base, pre=pre, mid=mid, post=lambda h, y, _tokens: wrapper.flow_mlp(h) + (y - h))


def _formula(model: nn.Module, cfg: SnfConfig) -> int:
    bb = backbone_of(model)
    d = bb.width()
    # Per flow: mu and log_sigma (2d), and per planar flow w, u (2d) and b (1); two flows per block.
    return bb.depth() * 2 * (2 * d + cfg.flow_length * (2 * d + 1))


# The backbones snf's idea fits: normalizing flows on both residual shortcuts of pre-norm blocks of one width.
BACKBONES = ("vit", "naflexvit", "vit_relpos", "beit", "eva")
# Why not on the other backbone kinds (the refusal says it, and so does the docs page).
REFUSAL = (
    "its normalizing flows on the residual shortcuts are built for one width, and a Swin's width changes per stage"
)
REFUSALS = {
    "vit_parallel": "its two flows replace the attention's and the MLP's residual shortcuts, and a parallel block "
    "has one"
}


@register_method(
    "snf",
    SnfConfig,
    trainable_formula=_formula,
    zero_init=True,
    backbones=BACKBONES,
    refusal=REFUSAL,
    refusals=REFUSALS,
    refusal_for=("swin", "swinv2", "swinv2_cr"),
)
def inject_snf(model: nn.Module, cfg: SnfConfig) -> None:
    """SNF: a normalizing flow on both shortcuts of every block."""
    bb = backbone_of(model)
    container, width = bb.block_container(), bb.width()
    for i in range(len(container)):
        bb.set_block(i, SnfBlock(container[i], width, cfg))


def apply_snf(model: nn.Module, **options: Any) -> nn.Module:
    """Put a normalizing flow on both residual shortcuts of every block; freeze everything else but the head.

    Args:
        model: a timm model of a backbone kind the method supports (its docs page; :func:`petl.list_backbones`).
        **options: fields of :class:`SnfConfig` (``flow_length``, ``num_classes``).

    Returns:
        The same model, modified in place.

    """
    return surgery.apply(model, "snf", **options)
