"""Where petl's user-facing presets live: the top-level ``configs/`` folder (suites, experiments).

In a source checkout (or an editable install) it sits beside the ``petl`` package; an installed
wheel carries it as the package ``petl.configs`` (``pyproject.toml`` maps that package onto the
same folder), found through :mod:`importlib.resources`.  Both ``petl-bench`` and anything else that
reads presets ask :func:`configs_dir`.
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path

PRESET_FOLDERS = ("experiments", "suites")


def _has_presets(folder: Path) -> bool:
    return all((folder / name).is_dir() for name in PRESET_FOLDERS)


def configs_dir(override: str | Path | None = None) -> Path:
    """The folder holding ``experiments/`` and ``suites/``.

    Args:
        override: an explicit folder (``configs_dir=`` / ``benchmarks_dir=`` on the command line).

    Returns:
        The override; else the checkout's top-level ``configs/``; else the installed ``petl.configs``.

    Raises:
        FileNotFoundError: naming the folders that were looked at.

    """
    if override is not None:
        candidates = [Path(override)]
    else:
        # The checkout first: an editable install of an older tree may still map petl.configs elsewhere.
        candidates = [Path(__file__).resolve().parent.parent / "configs"]
        try:
            candidates.append(Path(str(importlib.resources.files("petl.configs"))))
        except ModuleNotFoundError:
            pass
    for folder in candidates:
        if _has_presets(folder):
            return folder
    looked = ", ".join(str(c) for c in candidates)
    raise FileNotFoundError(
        f"no configs folder with experiments/ and suites/ at {looked}; pass configs_dir=PATH "
        "(a checkout of the petl repository has one at its root)"
    )
