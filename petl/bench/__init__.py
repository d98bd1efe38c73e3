"""Benchmark harness: suites of experiments run through ``petl.run.train``, leaderboards, speed tables.

``petl-bench`` (``petl.cli.bench``) is the command line; the pieces are importable for notebooks:
:func:`petl.bench.report.write_report` builds a leaderboard from any results folder.
"""

from petl.bench.report import aggregate, collect, write_report
from petl.bench.suite import load_experiment, load_suite

__all__ = ["aggregate", "collect", "load_experiment", "load_suite", "write_report"]
