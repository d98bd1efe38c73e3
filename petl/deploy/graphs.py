"""CUDA graphs of a :class:`petl.MultiTask`'s forward, one per batch layout, replayed where a layout repeats.

On a GPU a mixed batch's many small ops are bound by the host launching them (``MultiTask.launch_bound``); a CUDA
graph launches the whole forward at once (``torch.cuda.CUDAGraph``, as vLLM serves a fixed batch size).  A graph
holds the ops of one layout: which task's rows, how many, in which place of the batch sorted by task.  The rows'
place in the batch as it came (their order) is a tensor the graph reads, copied in before each replay, so that one
graph answers every batch with the same number of rows of each task, whatever their order (:class:`LayoutGraphs`),
as petl-predict's full batches of several runs have and a server's batches of one steady mix often do.  Where every
task's hooks stack (``MultiTask.every_row``), each row's task index is such a tensor too, and one graph per batch
size answers every mix of tasks, a batch padded to the next power of two rows for it.
"""

from __future__ import annotations

import threading
import warnings
from collections import Counter
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import nn

Tensor = torch.Tensor


def storage_of(module: nn.Module) -> tuple[Tensor, ...]:
    """``module``'s parameters and buffers as tensors of their present storage.

    A ``.to()`` swaps a Parameter's storage (``param.data = ...``), freeing the old one unless a tensor such as
    these still holds it.
    """
    return tuple(t.detach() for t in (*module.parameters(), *module.buffers()))


class LayoutGraph:
    """One batch layout's forward captured as a CUDA graph (:meth:`MultiTask.graphed`); call it with the images.

    It holds every tensor made outside the capture that the graph reads: the layout's row order and task indices
    (made before capturing, on the default memory pool), and the MultiTask's parameters, buffers and tables of the
    prompt slots' masks as captured (``weights``: their storage, which a later ``.to()`` replaces and frees).
    Freed, their memory would be handed to other tensors while the graph still reads it: a replay would gather rows
    at indices that are no longer the layout's, or multiply by whatever took a weight's place.
    """

    def __init__(
        self,
        graph: torch.cuda.CUDAGraph,
        images: Tensor,
        output: Tensor,
        layout: Any,
        weights: tuple[Tensor, ...] = (),
    ) -> None:
        self.graph, self.images, self.output, self.layout, self.weights = graph, images, output, layout, weights
        self._replaying = threading.Lock()  # a call from another thread would copy its images in midway

    def __call__(self, images: Tensor, layout: Any = None) -> Tensor:
        """The logits of ``images`` (of the captured shape, dtype and device), each row from its task.

        ``layout``: the batch's, where it is not the captured one (another batch with as many rows of each task, or
        any batch of a layout run every row): its row order and task indices are copied into the tensors the graph
        reads.
        """
        static = self.images
        if (images.shape, images.dtype, images.device) != (static.shape, static.dtype, static.device):
            raise ValueError(
                f"this graph answers {tuple(static.shape)} {static.dtype} images on {static.device}, got "
                f"{tuple(images.shape)} {images.dtype} on {images.device}: make a graph for that layout"
            )
        with self._replaying:
            with torch.inference_mode():  # the graph's own tensors were made under it: only it writes into them
                static.copy_(images)
                if layout is not None and layout is not self.layout:
                    self.layout.order.copy_(layout.order, non_blocking=True)
                    self.layout.rows.copy_(layout.rows, non_blocking=True)
                self.graph.replay()
            # Copied outside it: a plain tensor, as the eager forward gives under no_grad, which autograd may save.
            return self.output.clone()


def capture(
    run: Callable[[Tensor, Any], Tensor], images: Tensor, layout: Any, weights: tuple[Tensor, ...]
) -> LayoutGraph:
    """``run(images, layout)`` captured as a CUDA graph, after two warm-up runs on a side stream (torch's recipe).

    The warm-up makes cuDNN's and cuBLAS's choices, the tasks' per-device tensors and the tables of the prompt slots'
    masks, so that capturing copies nothing from the CPU.  ``weights``: the tensors the graph reads, held by the
    LayoutGraph.
    """
    # On the images' GPU, which need not be the current one (torch.cuda.graph captures on the current device).
    with torch.inference_mode(), torch.cuda.device(images.device):
        static = images.clone()
        side = torch.cuda.Stream(images.device)
        side.wait_stream(torch.cuda.current_stream(images.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                run(static, layout)
        torch.cuda.current_stream(images.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            output = run(static, layout)
    return LayoutGraph(graph, static, output, layout, weights)


class LayoutGraphs:
    """The CUDA graphs a MultiTask's forward keeps: one per layout that comes often, ``size`` at most.

    A layout (its key: the rows of each task, the images' shape, dtype and device, the autocast and TF32 in force) is
    captured once ``after`` batches of it have come, not at the first: a capture costs three forwards and a wait for
    the GPU, which a layout seen once would not pay back.  With ``size`` graphs kept, a layout takes the place of the
    least used graph only once it has come more often than that graph: a server whose batches mix tasks anew each
    time captures ``size`` graphs and then seldom another, instead of one at every batch.  Every count halves when
    the record of layouts grows past 64 per graph, so a mix that stopped coming gives way to one that comes now.
    Every graph is dropped when the MultiTask moves (``.to()``): it reads the weights' old memory.  Lowering ``size``
    drops the least used graphs past it (``size = 0`` every one), and a graph a layout replaces is dropped before that
    layout's capture: each holds the GPU memory of its forward's intermediate tensors.  A capture that fails (an op
    CUDA cannot capture) turns the graphs off, with a warning: every batch then runs eagerly.

    Attributes:
        captured: how many graphs were captured.
        replayed: how many batches a graph answered.

    """

    def __init__(self, size: int = 8, after: int = 2) -> None:
        self.graphs: dict[Hashable, LayoutGraph] = {}
        self.uses: Counter[Hashable] = Counter()  # batches per layout, captured or not
        self.size, self.after = size, after
        self.captured = self.replayed = 0

    @property
    def size(self) -> int:
        """The most graphs kept; set lower, the least used graphs past it are dropped (0: every one)."""
        return self._size

    @size.setter
    def size(self, size: int) -> None:
        # Dropped now, not at the next capture: a graph no batch replays would hold its GPU memory for ever (and none
        # is captured while size is 0).
        self._size = size
        while len(self.graphs) > max(size, 0):
            del self.graphs[min(self.graphs, key=self.uses.__getitem__)]

    def clear(self) -> None:
        self.graphs.clear()
        self.uses.clear()

    def answer(self, key: Hashable, images: Tensor, layout: Any, make: Callable[[], LayoutGraph]) -> Tensor | None:
        """The logits of ``images`` from the graph of ``key`` (made by ``make`` when it is worth one), or None where
        the forward runs eagerly.
        """
        if self.size <= 0:
            return None
        self.uses[key] += 1
        graph = self.graphs.get(key) or self._capture(key, make)
        if graph is None:
            return None
        self.replayed += 1
        return graph(images, layout)

    def _capture(self, key: Hashable, make: Callable[[], LayoutGraph]) -> LayoutGraph | None:
        """The graph of ``key`` where it has come often enough, in place of the least used graph if ``size`` are
        kept; None where not.
        """
        uses = self.uses[key]
        victim = min(self.graphs, key=self.uses.__getitem__) if len(self.graphs) >= self.size else None
        if uses < self.after or (victim is not None and uses <= self.uses[victim]):
            if len(self.uses) > 64 * self.size:
                self.uses = Counter({k: n // 2 for k, n in self.uses.items() if n // 2 or k in self.graphs})
            return None
        if victim is not None:  # dropped first: its memory is free for the capture (which empties torch's cache)
            del self.graphs[victim], self.uses[victim]
        try:
            graph = make()
        except RuntimeError as error:  # an op CUDA cannot capture: every batch eager, as without graphs
            self.size = 0
            self.clear()
            warnings.warn(
                f"MultiTask serves every batch eagerly: capturing a CUDA graph failed ({error})", stacklevel=4
            )
            return None
        self.graphs[key] = graph
        self.captured += 1
        return graph
