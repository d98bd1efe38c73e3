"""Helpers the re-parameterisable methods share when they fold their update into frozen weights.

Merging rewrites frozen weights in place, so it computes in at least float32 (a float16 weight
would lose the small update to rounding) and refuses to write non-finite values, which would
silently ruin the backbone and could not be undone.
"""

from __future__ import annotations

import torch


def work_dtype(tensor: torch.Tensor) -> torch.dtype:
    """The dtype to compute a merge in: float32 for half-precision tensors, their own dtype otherwise."""
    return torch.float32 if tensor.dtype in (torch.float16, torch.bfloat16) else tensor.dtype


def check_finite(what: str, *tensors: torch.Tensor) -> None:
    """Raise a ValueError naming ``what`` if any of ``tensors`` holds an inf or NaN."""
    if not all(bool(torch.isfinite(t).all()) for t in tensors):
        raise ValueError(f"refusing to merge {what}: it holds non-finite values (inf or NaN)")


def write(target: torch.Tensor, value: torch.Tensor, what: str) -> None:
    """Copy ``value`` into ``target`` in ``target``'s dtype, refusing values that are (or round to) inf/NaN."""
    value = value.to(target.dtype)
    check_finite(what, value)
    target.copy_(value)
