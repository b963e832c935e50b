"""Where kernels/ and templates/ are: the checkout's top level, or inside an installed wheel."""
from __future__ import annotations

from pathlib import Path

_PKG = Path(__file__).resolve().parent


def data_dir(name: str) -> Path:
    """The folder `name` ('kernels' or 'templates'), from a checkout or from the installed wheel."""
    for candidate in (_PKG.parent / name, _PKG / "_data" / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"DeepJIT's '{name}' folder is missing from {_PKG.parent} and {_PKG / '_data'}")
