"""petl's version, in one place: pyproject.toml reads it (``[tool.setuptools.dynamic]``), ``petl.__version__``
and petl-serve's API page show it.
"""

__version__ = "0.1.0"
