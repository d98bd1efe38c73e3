"""The random generators a training step draws from, saved in a checkpoint and restored on resume
(timm: ``utils/random.py``).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

# The largest seed a run takes: numpy seeds its global stream (accelerate's set_seed) from 0 to 2**32 - 1 only.
MAX_SEED = 2**32 - 1


def rng_state() -> dict[str, Any]:
    """Every random generator a training step may draw from, as tensors and plain values."""
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        # Stored as tensors and ints so the checkpoint loads with torch.load(weights_only=True).
        "numpy": (np_state[0], torch.from_numpy(np_state[1].copy()), *np_state[2:]),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` captured."""
    random.setstate(state["python"])
    name, key, *rest = state["numpy"]
    np.random.set_state((name, key.numpy(), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        # One state per GPU the saving process saw: a resume that sees fewer (another machine, CUDA_VISIBLE_DEVICES)
        # restores those it has; torch's set_rng_state_all would fail on the first GPU past them (an IndexError).
        torch.cuda.set_rng_state_all(state["cuda"][: torch.cuda.device_count()])
