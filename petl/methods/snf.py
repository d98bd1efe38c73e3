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

Speed: the planar flows run as one autograd function (:class:`PlanarFlows`) with a hand-written backward that
keeps only the chain's output and each flow's ``tanh`` (one value per token) and walks the chain back by
subtracting each flow's update, instead of autograd's copy of the tokens after every flow: the same values and
gradients (to float rounding, tested against autograd), in about a third of the time of the flows written as
16 modules and a fraction of their memory (``benchmarks/results/speed_cpu.md``).  It computes in the tokens'
dtype with autocast off, so a model under bf16 autocast trains its flows in float32.  Without autograd
(inference) the flows run one by one, which starts sooner on small batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from petl import core, multitask, vit


@dataclass
class SnfConfig(core.MethodConfig):
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
        core.check_range("flow_length", self.flow_length, low=0)
        for block in vit.blocks(model):
            vit.check_pre_norm_block(block)


class PlanarFlow(nn.Module):
    """One planar flow ``z + scale * tanh(z . weight + bias)``; its tensors start uniform(-0.01, 0.01) (the reference).

    Args:
        width: the token width d.
        kw: device and dtype of the new tensors.

    """

    def __init__(self, width: int, **kw: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(width, **kw).uniform_(-0.01, 0.01))
        self.scale = nn.Parameter(torch.empty(width, **kw).uniform_(-0.01, 0.01))
        self.bias = nn.Parameter(torch.empty(1, **kw).uniform_(-0.01, 0.01))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return z + self.scale * torch.tanh(z @ self.weight.unsqueeze(-1) + self.bias)


class PlanarFlows(torch.autograd.Function):
    """``K`` planar flows in order, ``z <- z + scale[k] * tanh(z . weight[k] + bias[k])``, in a fused autograd node.

    Autograd would keep the tokens after every flow for the backward (``K`` copies of the token tensor per
    shortcut).  The flows are invertible given their ``tanh`` values, so this keeps the output and the ``K``
    tanh values per token only, and recovers each flow's input in the backward as ``z - scale[k] * tanh_k``.
    """

    @staticmethod
    def forward(
        ctx: Any, z: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor
    ) -> torch.Tensor:
        """Apply the flows to ``z`` (..., d) with ``weight`` and ``scale`` (K, d) and ``bias`` (K,)."""
        with torch.autocast(z.device.type, enabled=False):
            shape, param_dtype = z.shape, weight.dtype
            weight, scale, bias = (t.to(z.dtype) for t in (weight, scale, bias))
            out = z.reshape(-1, shape[-1]).clone()
            tanh = out.new_empty(len(weight), len(out))
            for k in range(len(weight)):
                torch.tanh(torch.addmv(bias[k].expand(len(out)), out, weight[k]), out=tanh[k])
                out.addr_(tanh[k], scale[k])
        ctx.save_for_backward(out, tanh, weight, scale)
        ctx.shape, ctx.param_dtype = shape, param_dtype
        return out.view(shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Walk the flows back from the output, recovering each one's input from its tanh values."""
        out, tanh, weight, scale = ctx.saved_tensors
        with torch.autocast(grad.device.type, enabled=False):
            z, g = out.clone(), grad.reshape(out.shape).to(out.dtype).clone()
            grad_weight, grad_scale = torch.empty_like(weight), torch.empty_like(scale)
            grad_bias = weight.new_empty(len(weight))
            for k in reversed(range(len(weight))):
                z.addr_(tanh[k], scale[k], alpha=-1)  # flow k's input
                grad_scale[k] = tanh[k] @ g
                grad_pre = (g @ scale[k]) * (1 - tanh[k] * tanh[k])  # d loss / d (z . weight[k] + bias[k])
                grad_bias[k] = grad_pre.sum()
                grad_weight[k] = grad_pre @ z
                g.addr_(grad_pre, weight[k])
        dtype = ctx.param_dtype
        return g.view(ctx.shape), grad_weight.to(dtype), grad_scale.to(dtype), grad_bias.to(dtype)


class ShortcutFlow(nn.Module):
    """A normalizing flow of tokens: ``mu + exp(log_sigma) * z``, then ``length`` planar flows.

    Args:
        width: the token width d.
        length: the number of planar flows.
        kw: device and dtype of the new tensors.

    """

    def __init__(self, width: int, length: int, **kw: Any) -> None:
        super().__init__()
        self.mu = nn.Parameter(torch.zeros(width, **kw))
        self.log_sigma = nn.Parameter(torch.zeros(width, **kw))
        self.planar = nn.Sequential(*[PlanarFlow(width, **kw) for _ in range(length)])

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        z = self.mu + self.log_sigma.exp() * z
        if not len(self.planar) or not torch.is_grad_enabled():
            return self.planar(z)  # no backward to prepare: the flows one by one start sooner on small batches
        flows = list(self.planar)
        weight, scale = torch.stack([f.weight for f in flows]), torch.stack([f.scale for f in flows])
        return PlanarFlows.apply(z, weight, scale, torch.cat([f.bias for f in flows]))


class SnfBlock(core.PetlModule):
    """A frozen pre-norm timm block whose two shortcuts are normalizing flows.

    Args:
        base: the timm ``Block``; it stays frozen and is kept as ``base``.
        width: the token width.
        cfg: the method's options.

    """

    def __init__(self, base: nn.Module, width: int, cfg: SnfConfig) -> None:
        super().__init__(base)
        kw = core.factory_kwargs(base)
        self.flow_attn = ShortcutFlow(width, cfg.flow_length, **kw)
        self.flow_mlp = ShortcutFlow(width, cfg.flow_length, **kw)

    def forward(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        block = self.base
        x = self.flow_attn(x) + block.drop_path1(block.ls1(block.attn(block.norm1(x), **kwargs)))
        return self.flow_mlp(x) + block.drop_path2(block.ls2(block.mlp(block.norm2(x))))


@multitask.register_row_hook(SnfBlock)
def _rows(wrapper: SnfBlock) -> multitask.RowHook:
    # The frozen block runs once for the mixed batch as its two residual halves, x + attn and h + mlp; each task
    # swaps the identity shortcut in its rows for its flow.  pre keeps the rows' block input for mid (each task's
    # rows are one contiguous group, served pre -> mid -> post in one forward).
    held: dict[str, torch.Tensor] = {}

    def pre(x: torch.Tensor, _tokens: multitask.Tokens) -> None:
        held["x"] = x

    def mid(h: torch.Tensor, _tokens: multitask.Tokens) -> torch.Tensor:
        x = held.pop("x")
        return wrapper.flow_attn(x) + (h - x)

    return multitask.RowHook(wrapper.base, pre=pre, mid=mid, post=lambda h, y, _tokens: wrapper.flow_mlp(h) + (y - h))


def _formula(model: nn.Module, cfg: SnfConfig) -> int:
    d = vit.embed_dim(model)
    # Per flow: mu and log_sigma (2d), and per planar flow w, u (2d) and b (1); two flows per block.
    return vit.depth(model) * 2 * (2 * d + cfg.flow_length * (2 * d + 1))


@core.register_method("snf", SnfConfig, trainable_formula=_formula, zero_init=True)
def inject_snf(model: nn.Module, cfg: SnfConfig) -> None:
    """SNF: a normalizing flow on both shortcuts of every block."""
    container, width = vit.block_container(model), vit.embed_dim(model)
    for i in range(len(container)):
        vit.set_block(model, i, SnfBlock(container[i], width, cfg))


def apply_snf(model: nn.Module, **options: Any) -> nn.Module:
    """Put a normalizing flow on both residual shortcuts of every block; freeze everything else but the head.

    Args:
        model: a timm VisionTransformer.
        **options: fields of :class:`SnfConfig` (``flow_length``, ``num_classes``).

    Returns:
        The same model, modified in place.

    """
    return core.apply(model, "snf", **options)
