"""What the side-tuning methods (DTL, LST, HST, LAST) share: a side network that runs beside the frozen blocks.

A side network keeps state across blocks (DTL's running sum of low-rank features, LST's side stream),
yet timm's forward runs ``model.blocks`` itself, block by block.  So every block is wrapped in a
:class:`SideBlock` that calls the one side network with its own index: ``side.step(i, block, x)`` runs
the frozen block and whatever the side network does around it, and returns what the next block reads.
The side network's parameters are registered once, under block 0's wrapper (so saving, counting and
``.to()`` see them once); the other wrappers hold an unregistered reference to the same module.

The state lives on the side network between block 0 and the last block of one forward and is dropped
at the last block, so a finished forward holds no graph.

In a :class:`petl.MultiTask` mixed batch the frozen blocks run once for every row, and each task's side
network runs on its own rows only: the block wrapper's row hook is :meth:`SideNetwork.row_hook`, which each
side network writes from the same pieces as its :meth:`SideNetwork.step`.  timm's gradient checkpointing re-runs blocks
in the backward, which would run the side steps out of order: ``set_grad_checkpointing(True)`` is refused
(:attr:`SideBlock.no_grad_checkpointing`), and a block called out of order raises.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from petl.model import rows
from petl.model.backbone import backbone_of, unwrap
from petl.model.wrappers import PetlModule


def mlp_ratio(model: nn.Module) -> float:
    """The backbone MLP's hidden width over the block width, which the side blocks of LST and HST keep.

    What fc2 reads is the hidden width in every family (an EVA SwiGLU's fc1 holds gate and value rows; a parallel
    block has no fc1, its mlp_out_proj stands as fc2).
    """
    bb = backbone_of(model)
    return unwrap(bb.linear(bb.block_list()[0], "fc2")).in_features / bb.width()


class SideNetwork(nn.Module):
    """Base class of a side network: :meth:`step` runs frozen block ``index`` and the side network's part there."""

    def __init__(self, depth: int) -> None:
        super().__init__()
        self.depth = depth
        self._next = 0

    def check_order(self, index: int) -> None:
        """Raise unless block ``index`` is the one due (block 0 always starts a new forward)."""
        if index != 0 and index != self._next:
            raise RuntimeError(
                f"side network: block {index} ran after block {self._next - 1}; side-tuning methods need the "
                "blocks in order in one forward (gradient checkpointing re-runs them: turn it off)"
            )
        self._next = (index + 1) % self.depth

    def step(self, index: int, block: nn.Module, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """Run block ``index`` (frozen, kept as the wrapper's ``base``) on ``x``; return what the next block reads."""
        raise NotImplementedError

    def row_hook(self, index: int, block: nn.Module) -> rows.RowHook:
        """What :meth:`step` does around frozen block ``index``, as a :class:`petl.MultiTask` row hook.

        The hook sees the batch's prompt slots (other tasks' prompts) in the token sequence: a side network
        that mixes tokens (attention, a convolution over the grid) reads its rows without them.
        """
        raise rows.CannotShare(f"{type(self).__name__} has no multi-task hook yet")


class SideStream(SideNetwork):
    """A side network that runs as one stream beside the blocks (LST, LAST).

    It starts on block 0's input (:meth:`begin`) and reads every block's output (:meth:`after`), whose result,
    where there is one (after the last block), replaces what the next block or the pooling reads.
    """

    def begin(self, x: torch.Tensor) -> None:
        """Start the side stream on the tokens ``x`` entering block 0."""
        raise NotImplementedError

    def after(self, index: int, y: torch.Tensor) -> torch.Tensor | None:
        """Read block ``index``'s output ``y``; what replaces it (the side output after the last block), or ``None``."""
        raise NotImplementedError

    def step(self, index: int, block: nn.Module, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        if index == 0:
            self.begin(x)
        y = block(x, **kwargs)
        out = self.after(index, y)
        return y if out is None else out

    def row_hook(self, index: int, block: nn.Module) -> rows.RowHook:
        """The frozen block once for the batch; the task's side stream on its rows, without the prompt slots."""
        return self.stream_row_hook(index, block, self.after)

    def stream_row_hook(
        self, index: int, block: nn.Module, after: Callable[[int, torch.Tensor], torch.Tensor | None]
    ) -> rows.RowHook:
        """The row hook of the side stream, with ``after`` (:meth:`after`, or a served form of it) after each block.

        ``self.begin(x)`` reads block 0's input rows and ``after(index, y)`` each block's output rows, both
        without the prompt slots (the stream mixes tokens); what ``after`` returns replaces the rows' output,
        with zero-filled slots, which no task's pooling or head reads.
        """

        def begin(x: torch.Tensor, tokens: rows.Tokens) -> None:
            self.begin(tokens.without_slots(x))

        def post(x: torch.Tensor, y: torch.Tensor, tokens: rows.Tokens) -> torch.Tensor | None:
            out = after(index, tokens.without_slots(y))
            return None if out is None else tokens.with_slots(out)

        return rows.RowHook(block, pre=begin if index == 0 else None, post=post)


class SideBlock(PetlModule):
    """A frozen block that hands its forward to the side network's :meth:`SideNetwork.step`.

    Args:
        base: the timm block; it stays frozen and is kept as ``base``.
        side: the side network every block of the model shares.
        index: this block's position.

    """

    no_grad_checkpointing = (
        "its side network carries state from block to block in one forward, and checkpointing re-runs "
        "the blocks in the backward"
    )

    def __init__(self, base: nn.Module, side: SideNetwork, index: int) -> None:
        super().__init__(base)
        self.index = index
        if index == 0:
            self.network = side
        else:
            # A plain list is not registered: the parameters belong to block 0's wrapper alone.
            self._shared = [side]

    @property
    def side(self) -> SideNetwork:
        """The side network (registered under block 0, shared by reference elsewhere)."""
        return self.network if self.index == 0 else self._shared[0]

    def forward(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        self.side.check_order(self.index)
        return self.side.step(self.index, self.base, x, **kwargs)


@rows.register_row_hook(SideBlock)
def _rows(wrapper: SideBlock) -> rows.RowHook:
    # The frozen block runs once for the whole batch; each task's side network acts on its own rows.
    return wrapper.side.row_hook(wrapper.index, wrapper.base)


def install(model: nn.Module, side: SideNetwork) -> None:
    """Wrap every block of ``model`` in a :class:`SideBlock` sharing ``side``."""
    bb = backbone_of(model)
    container = bb.block_container()
    for i in range(len(container)):
        bb.set_block(i, SideBlock(container[i], side, i))
