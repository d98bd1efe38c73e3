"""A run's peak memory: the CUDA allocator's on a GPU, the process's resident-set high-water mark elsewhere
(read by petl-run's record and petl-bench speed).
"""

from __future__ import annotations

import platform
import resource

import torch


def peak_memory(device_type: str) -> tuple[float, str]:
    """Peak memory in MiB of a run on ``device_type``, and what it measures.

    CUDA's max allocated on a GPU, else the process's max RSS: also for a CPU run on a machine with a GPU, where
    the CUDA allocator's peak (zero, or an earlier GPU run's in the same process) is not the run's.
    """
    if device_type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20, "cuda_max_allocated"
    return peak_rss_mb(), "process_max_rss"


def reset_peak_rss() -> bool:
    """Reset the resident-set high-water mark (VmHWM, and with it ``ru_maxrss``) to the current RSS.

    Linux supports this by writing 5 to ``/proc/self/clear_refs``, so that runs sharing one process
    (a sweep, a notebook) each get their own peak.  Returns False where it is not supported, in which
    case a peak read later may belong to anything the process did before.
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def _status_mb(key: str) -> float | None:
    try:
        with open("/proc/self/status") as f:
            line = next((line for line in f if line.startswith(key + ":")), None)
    except OSError:
        return None
    return None if line is None else int(line.split()[1]) / 1024  # reported in kB


def current_rss_mb() -> float:
    """The resident set now, in MiB (the peak so far where /proc is unavailable)."""
    now = _status_mb("VmRSS")
    return peak_rss_mb() if now is None else now


def peak_rss_mb() -> float:
    """The resident-set high-water mark, in MiB."""
    # VmHWM is what clear_refs resets; ru_maxrss also keeps the peak of anything before an exec
    # (e.g. a launcher process), so it is only the fallback where /proc is missing.
    hwm = _status_mb("VmHWM")
    if hwm is not None:
        return hwm
    # ru_maxrss is in KiB on Linux, bytes on macOS.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**20 if platform.system() == "Darwin" else 2**10)
