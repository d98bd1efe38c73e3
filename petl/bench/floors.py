"""A method's floor: the least a training step of its model can cost, read off the model itself.

The frozen backbone's forward plus a backward that reaches the method's earliest trainable tensor, with the
method's extra tokens (prompts) added where they enter (see :mod:`petl.bench.speed`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from petl.model.backbone import backbone_of


@dataclass(frozen=True)
class Floor:
    """A method's lower bound: the frozen forward plus a backward that reaches its earliest trainable tensor.

    Attributes:
        start: the backbone module whose input the backward must reach: the innermost module that runs
            the method's earliest trainable tensor, named as in the plain backbone (``blocks.0.attn.qkv``
            for LoRA on Q/V, ``head`` for a linear probe); ``""`` for the whole model (the images).
        extra_tokens: tokens the method adds to the sequence (prompts), most over any block.
        extra_at: the first block that sees them.
        side: for a side-tuning method (its config's ``side_network``), the experiment whose side network
            the floor runs: the frozen blocks without autograd, the side network as the method runs it.
        frozen: for prompts a grid has no room for (a Swin's, which travel beside the grid and are copied into
            every window: zero tokens appended to the grid would not cost that), the experiment whose own model
            the floor runs with every parameter frozen, its prompts constants.

    """

    start: str
    extra_tokens: int = 0
    extra_at: int = 0
    side: str = ""
    frozen: str = ""

    def label(self) -> str:
        """The floor's row name."""
        if self.side:
            return f"floor: no-grad fwd + {self.side} side network"
        where = f"`{self.start}` input" if self.start else "images"
        tokens = f", +{self.extra_tokens} tokens from block {self.extra_at}" if self.extra_tokens else ""
        own = f" ({self.frozen}'s model, frozen)" if self.frozen else ""
        return f"floor: fwd + bwd to {where}{tokens}{own}"


def _observe(model, images, handles: list) -> None:
    """One no-grad eval forward of ``model`` with the given hooks in place, which are removed afterwards."""
    try:
        with torch.no_grad():
            model.eval()(images)
    finally:
        for handle in handles:
            handle.remove()


def tokens_per_block(model, images) -> list[int]:
    """How many tokens per image each block sees: what enters it inside any wrapper (so prompts a wrapper adds
    count) or, where more, what its wrapper returns (prompts of a wrapper that never calls the timm block's own
    forward: NOAH's, which runs the block's halves, and a Swin's, which travel beside its grid).
    """
    bb = backbone_of(model)
    seen: list[int] = [0] * bb.depth()

    def count(i: int, x) -> None:
        seen[i] = max(seen[i], bb.tokens_in(x))

    handles = [
        block.register_forward_pre_hook(lambda _m, args, i=i: count(i, args[0]))
        for i, block in enumerate(bb.block_list())
    ]
    handles += [
        block.register_forward_hook(lambda _m, _args, out, i=i: count(i, out))
        for i, block in enumerate(bb.block_container())
    ]
    _observe(model, images, handles)
    return seen


def _parent(path: str) -> str:
    return path.rsplit(".", 1)[0] if "." in path else ""


def run_order(model, images) -> dict[str, int]:
    """The names of ``model``'s modules whose forward runs on ``images``, each with its place in the order they run."""
    names = {module: name for name, module in model.named_modules()}
    order: dict[str, int] = {}

    def record(module, _args) -> None:  # a pre-hook returning a value would replace the module's input
        order.setdefault(names[module], len(order))

    _observe(model, images, [m.register_forward_pre_hook(record) for m in model.modules()])
    return order


def find_floor(model, images, plain_tokens: list[int], plain_modules: set[str], experiment: str = "") -> Floor:
    """Where ``model``'s earliest trainable tensor is used and how many tokens it adds (see :class:`Floor`).

    Read off the model, not the method's name: one forward with hooks records the order modules run in;
    each trainable parameter is placed at the innermost module that runs and holds it, and the earliest
    of those, mapped to the plain backbone's module of the same name (or its nearest ancestor there:
    a new adapter module maps to the block part it sits in), is where the floor's backward must reach.

    Args:
        model: the model with the method applied.
        images: a batch to run it on.
        plain_tokens: tokens the plain backbone feeds to each block (:func:`tokens_per_block` of it).
        plain_modules: the plain backbone's modules that run in its forward (:func:`run_order` of it): an
            EVA's, BEiT's or SwinV2's plain ``qkv`` does not (its attention reads ``qkv.weight`` itself), so a
            method's wrapped ``qkv`` maps to the attention around it.
        experiment: its name, which a ``frozen`` floor records.

    """
    order = run_order(model, images)
    places = []
    for name, param in model.named_parameters():
        if param.requires_grad:
            path = _parent(name)
            while path and path not in order:  # e.g. a ParameterDict, which never runs itself
                path = _parent(path)
            places.append((order[path], path))
    start = min(places)[1] if places else ""
    while start and start not in plain_modules:
        start = _parent(start)
    more = [t - p for t, p in zip(tokens_per_block(model, images), plain_tokens, strict=True)]
    extra = max(more)
    extra_at = next((i for i, t in enumerate(more) if t > 0), 0)
    if extra > 0 and backbone_of(model).layout != "sequence":
        # Zero tokens appended to a grid would be more grid, not prompts in every window: the method's own model.
        return Floor(start=start, extra_tokens=extra, extra_at=extra_at, frozen=experiment)
    return Floor(start=start, extra_tokens=max(0, extra), extra_at=extra_at if extra > 0 else 0)


def floor_hooks(model, floor: Floor) -> None:
    """Make the frozen ``model`` run ``floor``.

    Extra tokens (zeros) are inserted where they enter, after the prefix tokens, as prompts are, and every block
    from there on makes room for them as it does for prompts (:meth:`petl.Backbone.make_room`: a zero
    relative-position bias, no rotation); a ``frozen`` floor's model has its own prompts.  Then the input of
    ``floor.start`` is made to require grad, so the backward reaches exactly that far (hooks run in the order they
    were registered).
    """
    bb = backbone_of(model)
    start = model.get_submodule(floor.start) if floor.start else None  # before make_room wraps any attention
    at = bb.num_prefix_tokens()

    def add_tokens(_module, args):
        x = args[0]
        zeros = x.new_zeros(x.shape[0], floor.extra_tokens, x.shape[-1])
        return (torch.cat([x[:, :at], zeros, x[:, at:]], dim=1), *args[1:])

    def needing_grad(x):  # a tensor, or the (grid, prompts) pair a prompted Swin block passes on
        return x.detach().requires_grad_() if isinstance(x, torch.Tensor) else type(x)(map(needing_grad, x))

    if floor.extra_tokens and not floor.frozen:
        for block in bb.block_list()[floor.extra_at :]:
            bb.make_room(block, at)
        bb.block_container()[floor.extra_at].register_forward_pre_hook(add_tokens)
    if start is not None:
        start.register_forward_pre_hook(lambda _m, args: (needing_grad(args[0]), *args[1:]))
    if floor.side:
        # The method's own model, each frozen block run without autograd: what is left is the side network.
        modes: list[bool] = []

        def no_grad(_module, _args) -> None:
            modes.append(torch.is_grad_enabled())
            torch.set_grad_enabled(False)

        def restore(_module, _args, _out) -> None:  # a forward hook returning a value would replace the output
            torch.set_grad_enabled(modes.pop())

        for block in bb.block_list():
            block.register_forward_pre_hook(no_grad)
            block.register_forward_hook(restore)
