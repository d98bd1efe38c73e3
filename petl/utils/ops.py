"""Counting the aten ops a call dispatches: the cost of a step bound by the host launching kernels.

On a GPU, eager inference of small per-task updates (a mixed batch through :class:`petl.MultiTask`) and a LoRA
training step are bound by the host launching ops, not by their arithmetic, so the op count is the cost that
matters, and one that a CPU can count deterministically.
"""

from __future__ import annotations

import collections
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

# Ops that only alias or allocate: no kernel, no arithmetic.
FREE_OPS = frozenset(
    {
        "view", "_unsafe_view", "t", "transpose", "slice", "expand", "unsqueeze", "squeeze", "as_strided",
        "reshape", "alias", "permute", "detach", "split", "split_with_sizes", "narrow", "select", "empty",
        "empty_like", "new_empty", "new_empty_strided", "empty_strided",
    }
)  # fmt: skip


class CountOps(TorchDispatchMode):
    """Counts, by name, the aten ops dispatched inside it that compute something (:data:`FREE_OPS` left out).

    Use as ``with CountOps() as count: f()``; ``count.ops`` is a Counter.
    """

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = func.overloadpacket.__name__
        if name not in FREE_OPS:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))
