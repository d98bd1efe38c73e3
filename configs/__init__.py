"""petl's user-facing presets: benchmark suites (``suites/``) and experiments (``experiments/``).

This top-level folder is installed as the package ``petl.configs`` (see ``pyproject.toml``), so an
installed petl finds the same files a checkout has; :func:`petl.presets.configs_dir` locates them.
"""
