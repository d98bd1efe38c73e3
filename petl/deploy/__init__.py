"""Using trained runs: predict, export, MultiTask; a run is read through ``petl.store``."""
