"""The process's resident-set high-water mark, resettable on Linux so that each measurement gets its own peak."""

from __future__ import annotations

import resource
import sys


def reset_peak_rss() -> bool:
    """Reset the high-water mark (VmHWM, and with it ``ru_maxrss``) to the current RSS.

    Linux supports this by writing 5 to ``/proc/self/clear_refs``.  Returns False where it is not
    supported, in which case a peak read later may belong to anything the process did before.
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
    """The resident set now, in MB (the peak so far where /proc is unavailable)."""
    now = _status_mb("VmRSS")
    return peak_rss_mb() if now is None else now


def peak_rss_mb() -> float:
    """The resident-set high-water mark, in MB."""
    # VmHWM is what clear_refs resets; ru_maxrss also keeps the peak of anything before an exec
    # (e.g. a launcher process), so it is only the fallback where /proc is missing.
    hwm = _status_mb("VmHWM")
    if hwm is not None:
        return hwm
    # ru_maxrss is in kilobytes on Linux, bytes on macOS.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**20 if sys.platform == "darwin" else 1024)
