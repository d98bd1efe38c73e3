"""Training: config validation (:mod:`petl.train.config`), options, the engine, the loop (:mod:`petl.train.runner`).

``from petl.run import default_config, train`` is the public face of this package (kept for ``python -m petl.run``).
"""
