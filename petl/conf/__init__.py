"""Hydra configuration files of petl-run (``pkg://petl.conf``); the ``method``, ``data`` and ``model``
groups and the schema are generated in :mod:`petl.train.config`.
"""
