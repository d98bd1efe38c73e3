"""Using trained runs: predict, export, MultiTask and petl-serve; a run is read through ``petl.store``."""
