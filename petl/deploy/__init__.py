"""Serving trained runs: ``petl-serve`` (:mod:`petl.deploy.serve`) and its dynamic batcher."""
