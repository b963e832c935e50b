"""Lazy imports of optional heavy dependencies (Polygraphy's mod.lazy_import, in small)."""
from __future__ import annotations

import importlib
from types import ModuleType

from .errors import MissingDependency


class LazyModule:
    """A module imported on first attribute access; a clear MissingDependency if absent."""

    def __init__(self, name: str, why: str):
        self._name, self._why, self._mod = name, why, None

    def _load(self) -> ModuleType:
        if self._mod is None:
            try:
                self._mod = importlib.import_module(self._name)
            except ImportError as e:
                raise MissingDependency(f"{self._why}: cannot import '{self._name}' ({e})") from None
        return self._mod

    def available(self) -> bool:
        try:
            self._load()
            return True
        except MissingDependency:
            return False

    def __getattr__(self, attr: str):
        return getattr(self._load(), attr)


def lazy_import(name: str, why: str) -> LazyModule:
    return LazyModule(name, why)
