"""The process's resident-set high-water mark: re-exported from :mod:`petl.store.files`, its one home.

``petl.bench`` may import ``petl.run`` (never the reverse), so the run records own the RSS readers
and the benchmark harness uses them from there.
"""

from __future__ import annotations

from petl.store.files import current_rss_mb, peak_rss_mb, reset_peak_rss

__all__ = ["current_rss_mb", "peak_rss_mb", "reset_peak_rss"]
