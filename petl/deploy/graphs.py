"""CUDA graphs of a :class:`petl.MultiTask`'s forward, one per batch layout, replayed where a layout repeats.

On a GPU a mixed batch's many small ops are bound by the host launching them (``MultiTask.launch_bound``); a CUDA
graph launches the whole forward at once (``torch.cuda.CUDAGraph``, as vLLM serves a fixed batch size).  A graph
holds the ops of one layout: which task's rows, how many, in which place of the batch sorted by task.  The rows'
place in the batch as it came (their order) is a tensor the graph reads, copied in before each replay, so that one
graph answers every batch with the same number of rows of each task, whatever their order (:class:`LayoutGraphs`),
as petl-predict's full batches of several runs have and a server's batches of one steady mix often do.
"""

from __future__ import annotations

import warnings
from collections import Counter, OrderedDict
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

    It holds every tensor made outside the capture that the graph reads: the layout's row order, task indices and
    masks (made before capturing, on the default memory pool), and the MultiTask's parameters and buffers as
    captured (``weights``: their storage, which a later ``.to()`` replaces and frees).  Freed, their memory would be
    handed to other tensors while the graph still reads it: a replay would gather rows at indices that are no
    longer the layout's, or multiply by whatever took a weight's place.
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

    def __call__(self, images: Tensor, order: Tensor | None = None) -> Tensor:
        """The logits of ``images`` (of the captured shape, dtype and device), each row from its task.

        ``order``: the batch's row index of each row sorted by task, where it differs from the captured batch's
        (another batch with as many rows of each task): copied into the tensor the graph reads.
        """
        static = self.images
        if (images.shape, images.dtype, images.device) != (static.shape, static.dtype, static.device):
            raise ValueError(
                f"this graph answers {tuple(static.shape)} {static.dtype} images on {static.device}, got "
                f"{tuple(images.shape)} {images.dtype} on {images.device}: make a graph for that layout"
            )
        with torch.inference_mode():
            static.copy_(images)
            if order is not None and order is not self.layout.order:
                self.layout.order.copy_(order, non_blocking=True)
            self.graph.replay()
            return self.output.clone()


def capture(
    run: Callable[[Tensor, Any], Tensor], images: Tensor, layout: Any, weights: tuple[Tensor, ...]
) -> LayoutGraph:
    """``run(images, layout)`` captured as a CUDA graph, after two warm-up runs on a side stream (torch's recipe).

    The warm-up makes cuDNN's and cuBLAS's choices, the tasks' per-device tensors and the layout's masks, so that
    capturing copies nothing from the CPU.  ``weights``: the tensors the graph reads, held by the LayoutGraph.
    """
    with torch.inference_mode():
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
    """The CUDA graphs a MultiTask's forward keeps: one per layout seen ``after`` times, ``size`` at most.

    A layout (its key: the rows of each task, the images' shape, dtype and device, the autocast and TF32 in force)
    is captured the ``after``-th time a batch of it comes, not the first: a capture costs three forwards, which a
    layout seen once would not pay back.  Past ``size`` graphs, the one replayed longest ago is dropped (its memory
    freed).  Every graph is dropped when the MultiTask moves (``.to()``): it reads the weights' old memory.  A capture
    that fails (an op CUDA cannot capture) turns the graphs off, with a warning: every batch then runs eagerly.

    Attributes:
        captured: how many graphs were captured.
        replayed: how many batches a graph answered.

    """

    def __init__(self, size: int = 8, after: int = 2) -> None:
        self.size, self.after = size, after
        self.graphs: OrderedDict[Hashable, LayoutGraph] = OrderedDict()
        self.seen: Counter[Hashable] = Counter()
        self.captured = self.replayed = 0

    def clear(self) -> None:
        self.graphs.clear()
        self.seen.clear()

    def answer(self, key: Hashable, images: Tensor, layout: Any, make: Callable[[], LayoutGraph]) -> Tensor | None:
        """The logits of ``images`` from the graph of ``key`` (made by ``make`` once ``key`` has come ``after``
        times), or None where the forward runs eagerly.
        """
        graph = self.graphs.get(key)
        if graph is None:
            if self.size <= 0:
                return None
            self.seen[key] += 1
            if self.seen[key] < self.after:
                if len(self.seen) > 64 * self.size:  # layouts that never repeat: forget them, not the memory
                    self.seen = Counter({k: n for k, n in self.seen.items() if k in self.graphs})
                return None
            try:
                graph = self.graphs[key] = make()
            except RuntimeError as error:  # an op CUDA cannot capture: every batch eager, as without graphs
                self.size = 0
                warnings.warn(
                    f"MultiTask serves every batch eagerly: capturing a CUDA graph failed ({error})", stacklevel=3
                )
                return None
            self.captured += 1
            while len(self.graphs) > self.size:
                self.graphs.popitem(last=False)
        self.graphs.move_to_end(key)
        self.replayed += 1
        return graph(images, layout.order)
