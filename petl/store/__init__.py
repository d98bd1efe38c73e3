"""The run folder: the one package that writes and reads a run's files.

``config.yaml``, ``metrics.jsonl``, ``checkpoint.pt`` and the atomic writes (:mod:`petl.store.files`),
``result.json`` (:mod:`petl.store.result`), ``model.json`` and the trained weights (:mod:`petl.store.run_card`),
the folder's lock (:mod:`petl.store.lock`).  Training writes through it, deploy and bench read through it.
"""
