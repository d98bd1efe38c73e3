"""Numeric precision on a device, for training and inference alike: what ``auto`` means, TF32, bf16 autocast.

``train.precision`` (petl-run) and ``precision`` (petl-serve, petl-predict) share these names and meanings, so a
model serves in the precision it trained in by default.  Inference applies it as :func:`torch.autocast` around the
forward and torch's TF32 switch, never by casting the weights: the frozen weights stay fp32, so merging and loading
a run are unchanged, and a CPU's answers stay bit-identical to strict fp32 under ``auto``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from petl.utils.errors import ConfigError

log = logging.getLogger(__name__)

INFERENCE_PRECISIONS = ("auto", "no", "tf32", "bf16")
GPU_ONLY_PRECISIONS = ("tf32", "fp16")  # TF32 tensor cores, fp16 autocast: neither exists off a CUDA GPU


def cuda_has_native_bf16() -> bool:
    """Whether the CUDA GPU computes bf16 natively (Ampere and later), not through torch's emulation."""
    try:
        return torch.cuda.is_bf16_supported(including_emulation=False)
    except TypeError:  # a torch without the argument did not count emulation
        return torch.cuda.is_bf16_supported()


def cpu_supports_bf16() -> bool:
    """Whether this CPU has bf16 instructions (AVX512-BF16 or AMX); without them bf16 matmuls are emulated."""
    cpu = getattr(torch, "cpu", None)
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(cpu, name, lambda: False)()) for name in checks)


def auto_precision(device_type: str, native_bf16: bool | None = None) -> str:
    """What ``precision=auto`` means on a device: bf16 autocast on a CUDA GPU with native bf16, else ``no``.

    GPUs without native bf16 (before Ampere) have no TF32 either, so fp32 is all that is left there; on the CPU
    ``no`` keeps every result bit-identical to the runs made before ``auto`` was the default.  ``native_bf16``:
    whether the GPU has it; ``None`` asks this machine's GPU (:func:`cuda_has_native_bf16`).
    """
    if device_type != "cuda":
        return "no"
    return "bf16" if (cuda_has_native_bf16() if native_bf16 is None else native_bf16) else "no"


def uses_tf32(precision: str, device_type: str) -> bool:
    """Whether CUDA may run fp32 matmuls and convolutions on TF32 tensor cores in ``precision``.

    Everywhere but ``no`` (strict fp32) on a GPU: with ``tf32`` that is the point, and under bf16/fp16 autocast it
    covers what autocast leaves in fp32, as timm's train.py does.  A CPU has no TF32.
    """
    return device_type == "cuda" and precision != "no"


def refuse_gpu_only(setting: str, precision: str, device_type: str, where: str) -> None:
    """Refuse a precision that acts on a CUDA GPU only (:data:`GPU_ONLY_PRECISIONS`) where ``device_type`` is
    another: it would run as ``no`` (fp32) under another name, a value with no effect.

    The one rule of petl-run's ``train.precision`` and petl-serve's and petl-predict's ``precision``.

    Args:
        setting: the option's name, for the one line (``train.precision``, ``precision``).
        precision: its value.
        device_type: where the work runs (``cpu``, ``cuda``, ``mps``).
        where: what runs there, for the one line (``this run trains``).

    Raises:
        ConfigError: ``precision`` is GPU-only and ``device_type`` is not ``cuda`` (one line naming the value).

    """
    if precision in GPU_ONLY_PRECISIONS and device_type != "cuda":
        raise ConfigError(
            f"{setting}={precision} acts on a CUDA GPU only, and {where} on {device_type}: "
            f"give {setting}=no (or bf16, which CPUs autocast)"
        )


def inference_precision(precision: str, device_type: str) -> str:
    """The precision petl-serve and petl-predict run a forward in on ``device_type``: ``no``, ``tf32`` or ``bf16``.

    ``auto`` becomes :func:`auto_precision`; ``tf32`` off a CUDA GPU is refused as petl-run refuses it
    (:func:`refuse_gpu_only`); bf16 where the device lacks it (a CPU without bf16 instructions, a GPU without
    native bf16) falls back to ``no`` with one warning, as training does.

    Raises:
        ValueError: a value not in :data:`INFERENCE_PRECISIONS` (one line naming it); a :class:`ConfigError` for
            ``tf32`` off a CUDA GPU.

    """
    if precision not in INFERENCE_PRECISIONS:
        raise ValueError(f"precision={precision!r}: must be one of {', '.join(INFERENCE_PRECISIONS)}")
    if precision == "auto":
        return auto_precision(device_type)
    refuse_gpu_only("precision", precision, device_type, "the forward runs")
    if precision == "bf16" and device_type == "cpu" and not cpu_supports_bf16():
        log.warning("precision=bf16: this CPU has no bf16 instructions (AVX512-BF16/AMX): running in fp32")
        return "no"
    if precision == "bf16" and device_type == "cuda" and not cuda_has_native_bf16():
        log.warning("precision=bf16: this GPU has no native bf16 (before Ampere): running in fp32")
        return "no"
    return precision


def describe(precision: str, device_type: str) -> str:
    """``precision`` (resolved) in words, for a startup line or a log: ``bf16 autocast, TF32``, ``fp32``..."""
    words = ["bf16 autocast"] if precision == "bf16" else ["fp32"]
    if uses_tf32(precision, device_type):
        words.append("TF32")
    return ", ".join(words)


@contextmanager
def inference(precision: str, device_type: str) -> Iterator[None]:
    """Run the block in ``precision`` (resolved by :func:`inference_precision`): autocast and the TF32 switch.

    The TF32 switches are process-wide; they are put back on leaving, so a library caller's own settings survive.
    """
    cuda = device_type == "cuda"
    if cuda:
        before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = uses_tf32(precision, device_type)
    try:
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            yield
    finally:
        if cuda:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before
